"""RetentionCheckpoint in real Lightning fits: drop-in equality, state key, retention, "last", YAML, prune."""

from __future__ import annotations

import json
import os
import shutil

import lightning.pytorch as lightning
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_resume.cli import main as cli
from lightning_resume.errors import ConfigurationError
from lightning_resume.io.verify import problem as verify_problem
from lightning_resume.retention.checkpoint import RetentionCheckpoint
from lightning_resume.retention.naming import rolling_name
from lightning_resume.retention.policy import CheckpointRecord, RetentionPolicy
from tests.helpers.filesystem import listing
from tests.helpers.models import TINY_TRAINER, TinyData, TinyModel, tiny_fit, tiny_trainer
from tests.helpers.paths import REPO_ROOT

REPO = str(REPO_ROOT)


def _relative(state, dirpath):
    """A ModelCheckpoint state with paths made relative to its dirpath and tensors made floats."""

    def fix(value):
        if isinstance(value, str) and value.startswith(str(dirpath)):
            return os.path.relpath(value, dirpath)
        if isinstance(value, torch.Tensor):
            return float(value)
        if isinstance(value, dict):
            return {fix(k): fix(v) for k, v in value.items()}
        return value

    return {k: fix(v) for k, v in state.items() if k != "dirpath"}


DROP_IN_ARGS = [
    {},
    {"monitor": "val/loss", "save_top_k": 2},
    {"every_n_train_steps": 3, "save_top_k": -1},
    {"monitor": "val/loss", "save_last": True, "every_n_train_steps": 2},
    {"monitor": "val/loss", "mode": "max", "save_top_k": 1, "filename": "{epoch}-{val/loss:.3f}"},
]


@pytest.mark.parametrize("args", DROP_IN_ARGS, ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()) or "defaults")
def test_default_arguments_behave_exactly_like_model_checkpoint(tmp_path, args):
    stock = ModelCheckpoint(dirpath=tmp_path / "stock", **args)
    ours = RetentionCheckpoint(dirpath=tmp_path / "ours", **args)
    tiny_fit(stock)
    tiny_fit(ours)
    assert listing(tmp_path / "ours") == listing(tmp_path / "stock") != []
    assert _relative(ours.state_dict(), ours.dirpath) == _relative(stock.state_dict(), stock.dirpath)
    assert ours.state_key == stock.state_key
    assert os.path.basename(ours.best_model_path) == os.path.basename(stock.best_model_path)
    assert os.path.basename(ours.last_model_path) == os.path.basename(stock.last_model_path)


def test_state_key_matches_model_checkpoint_for_every_trigger():
    from datetime import timedelta

    for args in [
        {},
        {"monitor": "m", "mode": "max"},
        {"every_n_train_steps": 5},
        {"train_time_interval": timedelta(1)},
    ]:
        assert RetentionCheckpoint(**args).state_key == ModelCheckpoint(**args).state_key
    assert RetentionCheckpoint(retention=RetentionPolicy(keep_last=2)).state_key == ModelCheckpoint().state_key


def test_resume_from_a_model_checkpoint_run_keeps_best_k(tmp_path):
    stock = ModelCheckpoint(dirpath=tmp_path, monitor="val/loss", save_top_k=2, save_last=True)
    tiny_fit(stock)
    ours = RetentionCheckpoint(dirpath=tmp_path, monitor="val/loss", save_top_k=2, save_last=True)
    trainer = tiny_trainer([ours], max_epochs=3, limit_train_batches=4)
    trainer.fit(TinyModel(), datamodule=TinyData(), ckpt_path=str(tmp_path / "last.ckpt"))
    # the restored best-k bookkeeping is what the stock run wrote (training ran no further: max_epochs reached)
    assert ours.best_k_models.keys() == stock.best_k_models.keys()
    assert ours.best_model_path == stock.best_model_path
    assert float(ours.best_model_score) == float(stock.best_model_score)


RULES = {"keep_last": 2, "keep_best": 1, "anchor_every_n_steps": 5}


def retention(tmp_path, **kw):
    """On val/loss every 2 steps with ``RULES``; ``kw`` overrides the callback's arguments and the rules."""
    rules = {**RULES, **{k: kw.pop(k) for k in list(kw) if k in RULES}}
    args = {"dirpath": tmp_path, "monitor": "val/loss", "every_n_train_steps": 2, **kw}
    return RetentionCheckpoint(**args, retention=RetentionPolicy(**rules))


def test_retention_keeps_rolling_best_and_anchors(tmp_path):
    callback = retention(tmp_path)
    tiny_fit(callback, max_epochs=None, max_steps=16, val_check_interval=2)
    records = {r.step: r for r in callback._records.values()}
    policy_kept = {r.step for r in callback.policy.anchors(list(records.values()))} | {14, 16}
    best = min(records.values(), key=lambda r: r.metric)
    policy_kept.add(best.step)
    assert listing(tmp_path) == sorted(rolling_name(s) for s in policy_kept)
    assert {6, 10, 16} <= {r.step for r in records.values() if "anchor" in r.tags}
    assert callback.best_model_path == best.path
    assert torch.load(callback.best_model_path, weights_only=True)["global_step"] == best.step


def test_resume_continues_retention_and_keeps_resume_source(tmp_path):
    tiny_fit(retention(tmp_path, keep_best=None, anchor_every_n_steps=None), max_epochs=None, max_steps=8)
    resumed = retention(tmp_path, keep_best=None, anchor_every_n_steps=None)
    trainer = tiny_fit(resumed, ckpt_path=str(tmp_path / rolling_name(6)), max_epochs=None, max_steps=12)
    assert trainer.ckpt_path == str(tmp_path / rolling_name(6))
    # 6 is the resume source (protected); 8, written by the first run after 6, is pruned by keep_last
    assert listing(tmp_path) == [rolling_name(6), rolling_name(10), rolling_name(12)]
    assert [r.step for r in sorted(resumed._records.values(), key=lambda r: r.recency)] == [6, 10, 12]


def flip_a_byte_inside_a_tensor(path):
    """Corrupt one byte of the first tensor's stored bytes (a silent bit rot, not a truncation)."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size > 0)
    blob = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", blob[info.header_offset + 26 : info.header_offset + 30])
    blob[info.header_offset + 30 + name_len + extra_len] ^= 0xFF
    path.write_bytes(bytes(blob))


def test_last_skips_corrupt_newest_files(tmp_path):
    plain = dict(monitor=None, keep_last=4, keep_best=None, anchor_every_n_steps=None)
    tiny_fit(retention(tmp_path, **plain), max_epochs=None, max_steps=8)
    assert listing(tmp_path) == [rolling_name(s) for s in (2, 4, 6, 8)]
    newest, second = tmp_path / rolling_name(8), tmp_path / rolling_name(6)
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # truncated
    flip_a_byte_inside_a_tensor(second)
    for age, step in enumerate((8, 6, 4, 2)):  # modification order = save order, whatever the rewrites did
        os.utime(tmp_path / rolling_name(step), (1_700_000_000 - age,) * 2)
    callback = retention(tmp_path, **plain)
    with pytest.warns(UserWarning) as warned:
        trainer = tiny_fit(callback, ckpt_path="last", max_epochs=None, max_steps=10)
    messages = " ".join(str(w.message) for w in warned)
    assert str(newest) in messages and str(second) in messages
    assert trainer.ckpt_path == str(tmp_path / rolling_name(4))
    # the corrupt files were kept (never deleted on failed verification); training from 4 rewrote 6 and 8
    assert listing(tmp_path) == [rolling_name(s) for s in (4, 6, 8, 10)]
    assert all(verify_problem(str(tmp_path / rolling_name(s))) is None for s in (6, 8))


def test_save_snapshot_is_a_rolling_checkpoint(tmp_path):
    callback = retention(tmp_path, every_n_train_steps=1000, keep_last=2, keep_best=None, anchor_every_n_steps=None)

    class Snapshots(lightning.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step % 3 == 0:
                self.path = callback.save_snapshot(trainer, reason="test")

    snapshots = Snapshots()
    lightning.seed_everything(0, verbose=False)
    trainer = tiny_trainer([snapshots, callback], max_steps=10)
    trainer.fit(TinyModel(), datamodule=TinyData())
    assert snapshots.path == str(tmp_path / rolling_name(9))
    assert listing(tmp_path) == [rolling_name(6), rolling_name(9)]
    assert all("scheduled" in r.tags for r in callback._records.values())


def test_configuration_errors_name_every_problem():
    with pytest.raises(ConfigurationError) as info:
        RetentionPolicy(keep_last=0, anchor_every="soon")
    problems = " | ".join(info.value.problems)
    for needle in ("retention.keep_last=0 would delete", "retention.anchor_every='soon' is not a duration"):
        assert needle in problems
    with pytest.raises(ConfigurationError) as info:
        rules = RetentionPolicy(keep_last=1, mode="max")
        RetentionCheckpoint(retention=rules, save_top_k=3, monitor="m", filename="{epoch}")
    problems = " | ".join(info.value.problems)
    for needle in ("retention.mode='max' conflicts with mode='min'", "save_top_k=3", "filename='{epoch}' is unused"):
        assert needle in problems
    with pytest.raises(ConfigurationError, match=r"retention\.keep_best=2 needs a metric; set monitor"):
        RetentionCheckpoint(retention=RetentionPolicy(keep_best=2))


def test_the_policy_ranks_in_the_callbacks_mode():
    callback = RetentionCheckpoint(monitor="acc", mode="max", retention=RetentionPolicy(keep_best=1))
    assert callback.policy.mode == "max"
    assert RetentionCheckpoint(
        monitor="acc", mode="max", retention=RetentionPolicy(keep_best=1, mode="max")
    ).policy == (callback.policy)
    assert RetentionPolicy(anchor_every="6h") == RetentionPolicy(anchor_every=6 * 3600)  # held in seconds


def test_lightning_cli_runs_the_shipped_config(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = yaml.safe_load(open(os.path.join(REPO, "configs", "retention.yaml")))
    init = config["trainer"]["callbacks"][0]["init_args"]
    rules = init["retention"]
    assert (rules["keep_last"], rules["keep_best"], rules["anchor_every_n_steps"]) == (3, 2, 50_000)
    init.update(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2)
    rules.update(anchor_every_n_steps=4, anchor_every="6h")
    config["trainer"].update(TINY_TRAINER, max_steps=10, val_check_interval=2)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    lightning.seed_everything(0, verbose=False)
    run = LightningCLI(TinyModel, TinyData, args=["fit", "--config", str(path)], save_config_callback=None)
    (callback,) = [c for c in run.trainer.callbacks if isinstance(c, RetentionCheckpoint)]
    assert callback.policy.anchor_every == 6 * 3600.0
    assert callback.policy.keep_last == 3 and callback.policy.keep_best == 2
    names = listing(tmp_path / "ckpt")
    assert rolling_name(10) in names and rolling_name(4) in names and rolling_name(8) in names  # newest + anchors
    assert len(names) <= 3 + 2 + 2


def test_prune_dry_run_explains_and_prune_deletes(tmp_path, capsys):
    keep_all = retention(tmp_path, keep_last=10, keep_best=None, anchor_every_n_steps=None)
    tiny_fit(keep_all, max_epochs=None, max_steps=12, val_check_interval=2)
    shutil.copy(tmp_path / rolling_name(2), tmp_path / "epoch=0-step=2.ckpt")  # not ours: never deleted
    before = listing(tmp_path)
    args = ["prune", str(tmp_path), "--keep-last", "2", "--keep-best", "1", "--monitor", "val/loss"]
    assert cli.main(args + ["--dry-run", "--json"]) == 0
    rows = {os.path.basename(r["path"]): r for r in json.loads(capsys.readouterr().out)}
    assert listing(tmp_path) == before
    assert set(rows) == set(before)
    kept = {name for name, row in rows.items() if row["keep"]}
    best = min((r for r in rows.values() if r["metric"] is not None), key=lambda r: r["metric"])
    assert kept == {"epoch=0-step=2.ckpt", rolling_name(10), rolling_name(12), os.path.basename(best["path"])}
    assert "protected: not created by this callback" in rows["epoch=0-step=2.ckpt"]["reasons"]
    assert cli.main(args) == 0
    assert set(listing(tmp_path)) == kept
    assert "delete step=" in capsys.readouterr().out


def test_records_state_loads_with_weights_only(tmp_path):
    callback = retention(tmp_path)
    tiny_fit(callback, max_epochs=None, max_steps=6, val_check_interval=2)
    checkpoint = torch.load(callback.best_model_path, weights_only=True)
    saved = checkpoint["callbacks"][callback.state_key]["retention"]["records"]
    assert [CheckpointRecord.from_state(s).step for s in saved][-1] == checkpoint["global_step"]
    assert saved[-1]["in_flight"] is True  # the file's own save was in flight when its state was taken
