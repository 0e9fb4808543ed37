"""Issue 15.1-3, as attacks on RetentionCheckpoint in real fits.

- a hyper-parameter that used to save but never load (``re.I | re.M``) must not make
  ``ckpt_path="last"`` restart the run; when checkpoints exist and none loads, "last" raises;
- retention deletes only files it can prove it wrote (never by name);
- saves are ordered by training progress, not by a wall clock that can step back.
"""

import os
import re
import time
import types

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_resume.errors import NoLoadableCheckpointError
from lightning_resume.io.plugin import SafetensorsCheckpointIO
from lightning_resume.retention.checkpoint import RetentionCheckpoint
from lightning_resume.retention.naming import rolling_name
from lightning_resume.retention.policy import CheckpointRecord, RetentionPolicy
from tests.helpers.filesystem import listing
from tests.helpers.models import TinyData, TinyModel, tiny_fit, tiny_trainer


class FlagModel(TinyModel):
    def __init__(self, lr: float = 0.05, flags: re.RegexFlag = re.I | re.M) -> None:
        super().__init__(lr)
        self.save_hyperparameters()


def _fit(callback, ckpt_path=None, **kwargs):
    trainer = tiny_trainer([callback], plugins=[SafetensorsCheckpointIO()], max_epochs=None, **kwargs)
    trainer.fit(FlagModel(), datamodule=TinyData(), ckpt_path=ckpt_path)
    return trainer


def _rolling(tmp_path, keep_last=2, **kw):
    return RetentionCheckpoint(
        dirpath=tmp_path, every_n_train_steps=2, retention=RetentionPolicy(keep_last=keep_last), **kw
    )


def test_combined_regex_flags_in_hparams_resume_from_last(tmp_path):
    _fit(_rolling(tmp_path), max_steps=4)
    trainer = _fit(_rolling(tmp_path), ckpt_path="last", max_steps=6)
    assert trainer.ckpt_path == str(tmp_path / rolling_name(4))
    assert trainer.lightning_module.hparams["flags"] == re.I | re.M


def test_last_raises_naming_each_file_when_checkpoints_exist_but_none_loads(tmp_path):
    _fit(_rolling(tmp_path), max_steps=4)
    for step in (2, 4):
        path = tmp_path / rolling_name(step)
        path.write_bytes(path.read_bytes()[:100])
    before = listing(tmp_path)
    with pytest.raises(NoLoadableCheckpointError) as info:
        _fit(_rolling(tmp_path), ckpt_path="last", max_steps=6)
    for step in (2, 4):
        assert str(tmp_path / rolling_name(step)) in str(info.value)
    assert listing(tmp_path) == before  # nothing overwritten, nothing pruned


def test_a_fresh_run_never_prunes_an_earlier_runs_files_or_another_callbacks(tmp_path):
    stock = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    tiny_trainer([stock], max_epochs=None, max_steps=3).fit(TinyModel(), datamodule=TinyData())
    tiny_fit(_rolling(tmp_path, keep_last=3), max_epochs=None, max_steps=6)
    earlier = listing(tmp_path)
    assert {"step=1.ckpt", "step=3.ckpt", rolling_name(2), rolling_name(6)} <= set(earlier)
    tiny_fit(
        RetentionCheckpoint(dirpath=tmp_path, every_n_train_steps=5, retention=RetentionPolicy(keep_last=1)),
        max_epochs=None,
        max_steps=5,
    )
    # the new run wrote step 5 (and may overwrite nothing of theirs); every earlier file is still there
    assert set(earlier) <= set(listing(tmp_path))


def test_a_run_resumed_from_its_own_checkpoint_still_prunes_its_earlier_files(tmp_path):
    tiny_fit(_rolling(tmp_path, keep_last=3), max_epochs=None, max_steps=6)
    resumed = _rolling(tmp_path, keep_last=1)
    tiny_fit(resumed, ckpt_path=str(tmp_path / rolling_name(4)), max_epochs=None, max_steps=8)
    # 4: resume source (protected); 2 and the rewritten 6: pruned; 8: newest
    assert listing(tmp_path) == [rolling_name(4), rolling_name(8)]


def test_policy_orders_by_step_not_by_a_clock_that_stepped_back():
    early = CheckpointRecord("a", step=10, time=10_000.0, seq=1)
    late = CheckpointRecord("b", step=20, time=10_000.0 - 3600, seq=2)
    decisions = {d.record.path: d.keep for d in RetentionPolicy(keep_last=1).decide([early, late])}
    assert decisions == {"a": False, "b": True}


def test_resume_on_a_node_whose_clock_is_an_hour_behind_keeps_the_new_saves(tmp_path, monkeypatch):
    tiny_fit(_rolling(tmp_path), max_epochs=None, max_steps=4)
    behind = types.SimpleNamespace(time=lambda: time.time() - 3600)
    monkeypatch.setattr("lightning_resume.retention.checkpoint.time", behind)
    tiny_fit(_rolling(tmp_path), ckpt_path="last", max_epochs=None, max_steps=8)
    assert listing(tmp_path) == [rolling_name(4), rolling_name(6), rolling_name(8)]
    for step, mtime in ((4, 2_000_000_000), (6, 1_000_000_000), (8, 1_000_000_000)):  # file times lie too
        os.utime(tmp_path / rolling_name(step), (mtime, mtime))
    callback = _rolling(tmp_path)
    trainer = tiny_trainer([callback])
    trainer.state.fn = "fit"  # as fit() sets it before Lightning's "last" search
    assert callback._find_last_checkpoints(trainer) == {str(tmp_path / rolling_name(8))}
