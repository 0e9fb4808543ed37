"""The Tuner with ``ExactResume()`` (issue 39.4): ``lr_find``, ``scale_batch_size`` and their callbacks save the
trainer and restore it after their trial steps; that restore is no resume. A fit after them trains bit for bit
what it trains without ``ExactResume``, and a resume of that fit is still exact."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Optional

import lightning
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BatchSizeFinder, Callback, LearningRateFinder, ModelCheckpoint
from lightning.pytorch.tuner import Tuner
from torch import nn
from torch.utils.data import DataLoader

from lightning_resume import ExactResume, ResumeReport
from tests.helpers.models import QUIET, sum_data

pytestmark = pytest.mark.timeout(300)

STEPS = 12
TUNERS = ["Tuner.lr_find", "Tuner.scale_batch_size", "LearningRateFinder", "BatchSizeFinder"]


class LitModel(LightningModule):
    """Written the way Lightning's tuner docs write a tunable module: ``learning_rate`` and ``batch_size`` are
    hyperparameters the Tuner sets; dropout and a shuffled loader draw from the global RNG."""

    def __init__(self, learning_rate: float = 0.01, batch_size: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.learning_rate = learning_rate
        self.batch_size = batch_size
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.1), nn.Tanh(), nn.Linear(16, 1))
        self.loss_bits: list[bytes] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.loss_bits.append(struct.pack("<f", loss.item()))
        return loss

    def on_train_start(self):
        self.loss_bits = []  # the fit's own steps only: each of the Tuner's trials starts a training run too

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.learning_rate)

    def train_dataloader(self):
        return DataLoader(sum_data(96, noise=0.1), batch_size=self.batch_size, shuffle=True)


def _finder(tuner: str) -> list[Callback]:
    if tuner == "LearningRateFinder":
        return [LearningRateFinder(min_lr=1e-4, max_lr=0.5, num_training_steps=20)]
    if tuner == "BatchSizeFinder":
        return [BatchSizeFinder(init_val=2, max_trials=2, steps_per_trial=1)]
    return []


def _tune(trainer: Trainer, model: LitModel, tuner: str) -> None:
    if tuner == "Tuner.lr_find":
        Tuner(trainer).lr_find(model, min_lr=1e-4, max_lr=0.5, num_training=20)
    elif tuner == "Tuner.scale_batch_size":
        Tuner(trainer).scale_batch_size(model, init_val=2, max_trials=2, steps_per_trial=1)


def run(root: Path, tuner: str, exact: bool, ckpt_path: Optional[str] = None) -> tuple[LitModel, Trainer]:
    """One launch of the script: seed, build, tune, fit (resuming ``ckpt_path``), as a user writes it."""
    lightning.seed_everything(0, verbose=False)
    checkpoints = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=4, save_top_k=-1)
    callbacks: list[Callback] = [*_finder(tuner), checkpoints]
    if exact:
        callbacks.append(ExactResume(mtbf=None))
    trainer = Trainer(
        default_root_dir=root, max_steps=STEPS, limit_val_batches=0, accelerator="cpu", callbacks=callbacks, **QUIET
    )
    model = LitModel()
    _tune(trainer, model, tuner)
    trainer.fit(model, ckpt_path=ckpt_path)
    return model, trainer


def _weights(model: LitModel) -> list[bytes]:
    return [t.detach().numpy().tobytes() for t in model.state_dict().values()]


@pytest.mark.parametrize("tuner", TUNERS)
def test_a_fit_after_the_tuner_is_the_fit_without_exact_resume(tmp_path, tuner):
    stock, _ = run(tmp_path / "stock", tuner, exact=False)
    ours, trainer = run(tmp_path / "exact", tuner, exact=True)
    assert len(stock.loss_bits) == STEPS
    assert ours.loss_bits == stock.loss_bits  # every loss bit: the tuner's restore started nothing
    assert _weights(ours) == _weights(stock)
    assert (ours.learning_rate, ours.batch_size) == (stock.learning_rate, stock.batch_size)
    exact = next(cb for cb in trainer.callbacks if isinstance(cb, ExactResume))
    assert exact.resume_report == ResumeReport()  # a fresh start, not a resume of the tuner's temporary file
    assert not list(tmp_path.rglob(".lr_find_*")) and not list(tmp_path.rglob(".scale_batch_size_*"))


@pytest.mark.parametrize("tuner", TUNERS)
def test_a_resume_of_a_tuned_run_is_exact(tmp_path, tuner):
    """Uninterrupted (A) against a relaunch of the same script resuming A's step-4 checkpoint (C), which tunes
    again as the script does; C's steps are A's after step 4, bit for bit."""
    a, _ = run(tmp_path / "a", tuner, exact=True)
    step4 = tmp_path / "a" / "ckpt" / "epoch=0-step=4.ckpt"
    c, trainer = run(tmp_path / "c", tuner, exact=True, ckpt_path=str(step4))
    exact = next(cb for cb in trainer.callbacks if isinstance(cb, ExactResume))
    assert exact.resume_report.source == str(step4)  # the tuner's restore did not replace the resume's source
    assert exact.resume_report.exact, exact.resume_report
    assert c.loss_bits == a.loss_bits[4:]
    assert _weights(c) == _weights(a)
