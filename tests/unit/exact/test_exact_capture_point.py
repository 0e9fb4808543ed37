"""A checkpoint records where in the loop it was captured; only a step boundary resumes as exact.

A save from inside a training step (what Lightning's SLURM handler does from SIGUSR1, or an exception
hook) holds half-done work: resuming from it must say ``exact=False`` and why, and resume (it fits the run).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_resume import ExactResume, ExactResumeWarning
from tests.helpers.callbacks import SaveAt as SaveAtBoundary
from tests.helpers.jobs.trainee import Model
from tests.helpers.models import tiny_trainer


class SaveInside(Callback):
    """Writes a checkpoint from inside the training step of ``step`` (before its optimizer step)."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.step and not self.path.exists():
            trainer.save_checkpoint(self.path)


def _fit(tmp_path: Path, callbacks: list, exact: ExactResume, ckpt_path=None, steps: int = 6) -> pl.Trainer:
    trainer = tiny_trainer([exact, *callbacks], max_steps=steps, enable_checkpointing=False, limit_val_batches=0)
    torch.manual_seed(0)
    trainer.fit(Model({"out": str(tmp_path), "n": 200, "batch_size": 4}), ckpt_path=ckpt_path)
    return trainer


def test_a_checkpoint_saved_inside_a_step_resumes_as_not_exact_and_says_why(tmp_path: Path) -> None:
    inside = tmp_path / "inside.ckpt"
    _fit(tmp_path, [SaveInside(inside, step=3)], ExactResume(preemption=None))
    state = torch.load(inside, weights_only=True)["callbacks"]["ExactResume"]
    assert state["captured_at"] == "inside_training_step"

    exact = ExactResume(preemption=None, strict=False)
    with pytest.warns(ExactResumeWarning, match="captured inside training step"):
        _fit(tmp_path, [], exact, ckpt_path=str(inside))
    assert exact.resume_report.exact is False
    assert any("inside training step" in line for line in exact.resume_report.differences)

    # not a mismatch with the run: Lightning's own mid-step checkpoints resume under strict=True too, said so
    exact = ExactResume(preemption=None)
    with pytest.warns(ExactResumeWarning, match="captured inside training step"):
        _fit(tmp_path, [], exact, ckpt_path=str(inside))
    assert exact.resume_report.exact is False


def test_a_checkpoint_saved_at_a_step_boundary_is_exact(tmp_path: Path) -> None:
    boundary = tmp_path / "boundary.ckpt"
    _fit(tmp_path, [SaveAtBoundary(boundary, step=3)], ExactResume(preemption=None))
    state = torch.load(boundary, weights_only=True)["callbacks"]["ExactResume"]
    assert state["captured_at"] == "step_boundary"
    exact = ExactResume(preemption=None)
    _fit(tmp_path, [], exact, ckpt_path=str(boundary))
    assert exact.resume_report.exact is True and exact.resume_report.fingerprint_ok is True
