"""Retention over every checkpoint format the product writes: safetensors files are verified by their
checksums whatever IO the current run has, and prune deletes only what the policy says."""

from __future__ import annotations

import lightning.pytorch as lightning
import pytest

from lightning_resume import RetentionCheckpoint, RetentionPolicy, SafetensorsCheckpointIO
from lightning_resume.cli import main as cli
from lightning_resume.format.read import is_safetensors
from lightning_resume.io.verify import problem as verify_problem
from lightning_resume.io.verify import verify as verify_file
from lightning_resume.retention.naming import rolling_name
from tests.helpers.filesystem import listing
from tests.helpers.models import TinyData, TinyModel, tiny_trainer


def _fit(tmp_path, plugins, max_steps: int, ckpt_path=None, **rules):
    lightning.seed_everything(0, verbose=False)
    callback = RetentionCheckpoint(dirpath=tmp_path, every_n_train_steps=2, retention=RetentionPolicy(**rules))
    trainer = tiny_trainer([callback], plugins=plugins, max_epochs=None, max_steps=max_steps, limit_train_batches=4)
    trainer.fit(TinyModel(), datamodule=TinyData(), ckpt_path=ckpt_path)
    return trainer


def test_safetensors_files_verify_without_the_io_that_wrote_them(tmp_path) -> None:
    _fit(tmp_path, [SafetensorsCheckpointIO()], 8, keep_last=10)
    names = listing(tmp_path)
    assert names == [rolling_name(s) for s in (2, 4, 6, 8)]
    # judged by their content, with no IO given (as the prune command and a run with another IO do)
    assert all(is_safetensors(str(tmp_path / n)) and verify_problem(str(tmp_path / n)) is None for n in names)
    damaged = tmp_path / names[0]
    data = bytearray(damaged.read_bytes())
    data[-3] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert "checksum" in verify_problem(str(damaged))


def test_prune_deletes_exactly_what_the_policy_says(tmp_path, capsys) -> None:
    _fit(tmp_path, [SafetensorsCheckpointIO()], 10, keep_last=10)
    (tmp_path / "broken.ckpt").write_bytes(b"\x00" * 100)  # unreadable: reported, never deleted
    assert cli.main(["prune", str(tmp_path), "--keep-last", "2"]) == 0
    out = capsys.readouterr().out
    assert "delete step=000000002.ckpt" in out and "keep   broken.ckpt" in out
    assert listing(tmp_path) == ["broken.ckpt", rolling_name(8), rolling_name(10)]
    for step in (8, 10):
        verify_file(str(tmp_path / rolling_name(step)))


def test_a_hostile_file_does_not_stop_last_from_finding_a_good_one(tmp_path) -> None:
    _fit(tmp_path, [SafetensorsCheckpointIO()], 4, keep_last=10)
    newest = tmp_path / rolling_name(6)
    newest.write_bytes(b"PK\x03\x04" + b"\xff" * 64)  # claims to be a zip, is not
    with pytest.warns(UserWarning, match="step=000000006.ckpt"):
        trainer = _fit(tmp_path, [SafetensorsCheckpointIO()], 6, ckpt_path="last", keep_last=10)
    assert trainer.ckpt_path == str(tmp_path / rolling_name(4))


def test_lightnings_async_io_is_refused_with_the_fix(tmp_path) -> None:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from lightning_resume import ConfigurationError

    with pytest.raises(ConfigurationError, match="SafetensorsCheckpointIO\\(save='async'\\)"):
        _fit(tmp_path, [AsyncCheckpointIO()], 4, keep_last=2)
