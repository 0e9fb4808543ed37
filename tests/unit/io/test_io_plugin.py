"""SafetensorsCheckpointIO inside real Lightning fits: resume bit for bit, "last" skips corrupt files."""

from __future__ import annotations

import os
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_resume import SafetensorsCheckpointIO, SkippedCheckpointWarning
from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.format.read import is_safetensors
from lightning_resume.protocols import VerifyingCheckpointIO
from tests.helpers.models import TinyWithScheduler as Tiny


class StartStep(Callback):
    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step


def _trainer(root, max_steps, callbacks=(), plugins=True, max_epochs=None):
    return L.Trainer(
        default_root_dir=str(root), max_steps=max_steps, max_epochs=max_epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", devices=1, callbacks=list(callbacks),
        plugins=[SafetensorsCheckpointIO()] if plugins else None,
    )  # fmt: skip


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_fit_resume_is_bitwise_equal_to_uninterrupted(tmp_path):
    L.seed_everything(1)
    full = Tiny()
    _trainer(tmp_path / "full", -1, max_epochs=3).fit(full)

    L.seed_everything(1)
    first = Tiny()
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_top_k=-1, save_last=True)  # at epoch end (8 steps)
    _trainer(tmp_path / "a", -1, [ckpt], max_epochs=1).fit(first)
    last = str(tmp_path / "ck" / "last.ckpt")
    assert is_safetensors(last), "ModelCheckpoint's *.ckpt names hold our format"

    L.seed_everything(123)  # a fresh process would not share the first run's seed state
    resumed, start = Tiny(), StartStep()
    callbacks = [ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_top_k=-1, save_last=True), start]
    _trainer(tmp_path / "b", -1, callbacks, max_epochs=3).fit(resumed, ckpt_path="last")
    assert start.step == 8
    want, got = _weights(full), _weights(resumed)
    for k in want:
        assert torch.equal(want[k], got[k]), k


def _run_with_checkpoints(root):
    L.seed_everything(0)
    ckpt = ModelCheckpoint(dirpath=str(root / "ck"), every_n_train_steps=2, save_top_k=-1, save_last=True)
    _trainer(root, 4, [ckpt]).fit(Tiny())
    return root / "ck"


def _flip_last_byte(path):
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


def test_last_resolves_to_newest_verified_checkpoint(tmp_path):
    ck = _run_with_checkpoints(tmp_path)
    assert sorted(os.listdir(ck)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    _flip_last_byte(ck / "last.ckpt")
    _flip_last_byte(ck / "epoch=0-step=4.ckpt")
    start = StartStep()
    with pytest.warns(SkippedCheckpointWarning) as record:
        _trainer(tmp_path / "r", 6, [ModelCheckpoint(dirpath=str(ck), save_last=True), start]).fit(
            Tiny(), ckpt_path="last"
        )
    messages = " | ".join(str(w.message) for w in record)
    assert "epoch=0-step=4.ckpt" in messages and "last.ckpt failed verification" in messages
    assert start.step == 2, "resumed from the newest file that verifies"


def test_explicit_corrupt_path_is_never_substituted(tmp_path):
    ck = _run_with_checkpoints(tmp_path)
    _flip_last_byte(ck / "epoch=0-step=4.ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error", SkippedCheckpointWarning)
        with pytest.raises(CheckpointCorruptError, match="epoch=0-step=4.ckpt"):
            SafetensorsCheckpointIO().load_checkpoint(str(ck / "epoch=0-step=4.ckpt"))


def test_plugin_satisfies_protocol_and_validates_options():
    from lightning_resume.errors import ConfigurationError

    assert isinstance(SafetensorsCheckpointIO(), VerifyingCheckpointIO)
    with pytest.raises(ConfigurationError, match="checksum='md4'"):
        SafetensorsCheckpointIO(checksum="md4")


def test_lightning_cli_yaml_plugin(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  logger: false\n  max_steps: 1\n  plugins:\n"
        "    - class_path: lightning_resume.SafetensorsCheckpointIO\n      init_args:\n        checksum: crc32\n"
    )
    cli = LightningCLI(Tiny, run=False, args=["--config", str(config)], save_config_callback=None)
    io = cli.trainer.strategy.checkpoint_io
    assert isinstance(io, SafetensorsCheckpointIO) and io.checksum == "crc32"
