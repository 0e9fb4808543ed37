"""With ``SafetensorsCheckpointIO`` the save hashes no weights on the training thread (the file records and
verifies every tensor's digest); the check after restore compares the restored state with the loaded
checkpoint instead, and still refuses a state that was not restored as saved."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_resume import ExactResume, ResumeMismatchError, SafetensorsCheckpointIO
from lightning_resume.exact.state import fingerprint
from lightning_resume.format.read import load_file
from tests.helpers.callbacks import SaveAt
from tests.helpers.jobs.trainee import Model
from tests.helpers.models import tiny_trainer


class Perturbed(Model):
    """Changes one weight after Lightning restored it and before training: not the state that was saved."""

    def on_fit_start(self) -> None:
        with torch.no_grad():
            next(self.parameters()).add_(1e-3)


def _fit(tmp_path: Path, exact: ExactResume, callbacks=(), ckpt_path=None, model=Model, io=True) -> pl.Trainer:
    plugins = [SafetensorsCheckpointIO()] if io else []
    trainer = tiny_trainer(
        [exact, *callbacks], max_steps=6, enable_checkpointing=False, limit_val_batches=0, plugins=plugins
    )
    torch.manual_seed(0)
    trainer.fit(model({"out": str(tmp_path), "n": 200, "batch_size": 4}), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "step3.ckpt"
    _fit(tmp_path, ExactResume(preemption=None), [SaveAt(path, 3)])
    return path


def test_the_save_hashes_no_weights_and_the_resume_checks_them_against_the_file(saved: Path, tmp_path: Path):
    state = load_file(str(saved)).checkpoint["callbacks"]["ExactResume"]
    (rank,) = state["ranks"]
    assert "weights" not in rank["fingerprint"] and "optimizer" not in rank["fingerprint"]
    assert rank["fingerprint"]["hash"] == fingerprint.HASH and "rng" in rank["fingerprint"]
    exact = ExactResume(preemption=None)
    _fit(tmp_path, exact, ckpt_path=str(saved))
    assert exact.resume_report.exact is True and exact.resume_report.fingerprint_ok is True


def test_a_state_changed_after_the_load_is_still_refused(saved: Path, tmp_path: Path):
    with pytest.raises(ResumeMismatchError, match="fingerprint after restore: weights"):
        _fit(tmp_path, ExactResume(preemption=None), ckpt_path=str(saved), model=Perturbed)


def test_without_the_verified_format_the_save_keeps_hashing_the_weights(tmp_path: Path):
    path = tmp_path / "torch.ckpt"
    _fit(tmp_path, ExactResume(preemption=None), [SaveAt(path, 3)], io=False)
    rank = torch.load(path, weights_only=True)["callbacks"]["ExactResume"]["ranks"][0]
    assert {"weights", "optimizer", "hash"} <= set(rank["fingerprint"])
    with pytest.raises(ResumeMismatchError, match="fingerprint after restore: weights"):
        _fit(tmp_path, ExactResume(preemption=None), ckpt_path=str(path), model=Perturbed, io=False)


def test_a_fingerprint_that_names_another_hash_is_one_mismatch_not_compared_digest_by_digest():
    state = {"w": torch.arange(6.0)}
    made = fingerprint.fingerprint(state, [], {}, None, 3)
    assert made["hash"] == fingerprint.HASH and fingerprint.fingerprint_mismatches(made, made, ["weights"]) == []
    unnamed = {part: value for part, value in made.items() if part != "hash"}
    assert fingerprint.fingerprint_mismatches(unnamed, made, ["weights", "step"]) == [
        "hash: the checkpoint's fingerprint names None, this version makes 'xxh3-128'"
    ]
