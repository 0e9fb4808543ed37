"""``prove``'s verdict on traces real fits record, in this process (no spawning: cheap enough for every CI run).

Run A trains 12 steps uninterrupted; run B stops after step 6 (where a kill after its save would leave it)
and a relaunch resumes ``ckpt_path="last"`` to step 12, as a user's script does: both record the trace
``lightning-resume prove`` compares. An exact run whose snapshot schedule fires at other steps in A and B
(the steps a wall-clock schedule takes depend on machine speed) is EXACT; a seeded bug of each kind is
DIFFERS naming the component and the cause the recorded evidence gives, or "not sure" where it gives none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as lightning
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_resume import ExactResume, ScheduleOptions
from lightning_resume.errors import ExactResumeWarning
from lightning_resume.prove import trace
from lightning_resume.prove.compare import Verdict, compare, read_trace
from tests.helpers.models import TinyData, TinyModel, tiny_trainer

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.filterwarnings("ignore::lightning_resume.errors.ExactResumeWarning"),
]

STEPS, STOP = 12, 6


def _launch(
    monkeypatch, root: Path, make: Callable[[], tuple[Any, Any]], max_steps: int, resume: bool, **exact
) -> None:
    """One launch of the user's script in ``root``: seeded, its trace in ``root/trace``, saving every 2 steps."""
    monkeypatch.setenv(trace.TRACE_ENV, str(root / "trace"))
    monkeypatch.setenv(trace.DIGEST_EVERY_ENV, "1")
    lightning.seed_everything(0, verbose=False)
    model, data = make()
    callbacks = [ExactResume(**{"mtbf": None, **exact}), ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2)]
    trainer = tiny_trainer(callbacks, max_steps=max_steps)
    trainer.fit(model, datamodule=data, ckpt_path="last" if resume else None)


def _prove(tmp_path: Path, monkeypatch, make: Callable[[], tuple[Any, Any]], **exact) -> Verdict:
    _launch(monkeypatch, tmp_path / "A", make, STEPS, False, **exact)
    _launch(monkeypatch, tmp_path / "B", make, STOP, False, **exact)
    _launch(monkeypatch, tmp_path / "B", make, STEPS, True, **exact)
    return compare(read_trace(tmp_path / "A" / "trace"), read_trace(tmp_path / "B" / "trace"))


def _timed_steps(directory: Path) -> list[int]:
    return [r["step"] for r in read_trace(directory)[0] if r["kind"] == "saved" and r.get("timed")]


def _plain() -> tuple[Any, Any]:
    return TinyModel(), TinyData()


def test_an_exact_run_whose_snapshots_come_at_other_steps_is_exact(tmp_path, monkeypatch):
    """The reported case (a run longer than min_interval): snapshots at steps the schedule chose per launch."""
    verdict = _prove(tmp_path, monkeypatch, _plain, schedule=ScheduleOptions(every_n_train_steps_max=5))
    a, b = _timed_steps(tmp_path / "A" / "trace"), _timed_steps(tmp_path / "B" / "trace")
    assert a and b and a != b, (a, b)  # the two runs snapshot at different steps
    assert verdict.exact, verdict
    snapshot_files = [p.name for p in (tmp_path / "B" / "ckpt").iterdir() if p.name.startswith("last-snapshot")]
    assert snapshot_files == [], "superseded by step 12's checkpoint at the clean end"


class NoisyModel(TinyModel):
    """Adds noise from a generator of its own to each batch, as augmentation code does."""

    def __init__(self) -> None:
        super().__init__()
        self.noise = torch.Generator().manual_seed(1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return super().training_step([x + 0.1 * torch.randn(x.shape, generator=self.noise), y], batch_idx)


GLOBAL_NOISE: dict[str, torch.Generator] = {}


class GlobalNoiseModel(TinyModel):
    """The same noise from a generator kept in a global: no walk of the model reaches it."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        noise = GLOBAL_NOISE.setdefault("g", torch.Generator().manual_seed(1))
        return super().training_step([x + 0.1 * torch.randn(x.shape, generator=noise), y], batch_idx)


def test_a_generator_on_the_model_is_saved_and_proves_exact(tmp_path, monkeypatch):
    """ExactResume finds a generator the model holds and saves it: nothing is recorded as unsaved, and the run is
    EXACT (naming an unsaved generator from the recorded finding is ``test_compare``'s)."""
    verdict = _prove(tmp_path, monkeypatch, lambda: (NoisyModel(), TinyData()))
    start = read_trace(tmp_path / "B" / "trace")[0][0]
    assert [f for f in start["findings"] if f["kind"] == "unsaved_generator"] == []
    assert verdict.exact, verdict


def test_a_generator_nothing_recorded_is_not_sure(tmp_path, monkeypatch):
    GLOBAL_NOISE.clear()

    def make() -> tuple[Any, Any]:
        GLOBAL_NOISE.clear()  # each launch is a new process: the global starts over
        return GlobalNoiseModel(), TinyData()

    verdict = _prove(tmp_path, monkeypatch, make)
    assert (verdict.exact, verdict.component, verdict.step) == (False, "loss", STOP)
    assert not verdict.sure and verdict.cause.startswith("not sure why the loss differs at step 6")


class MyLoader(DataLoader):
    """A DataLoader subclass: ExactResume leaves it as it is, so its position is not saved."""


class ShuffledData(TinyData):
    def train_dataloader(self):
        return MyLoader(self.data, batch_size=self.batch_size, shuffle=True)


def test_a_loader_without_a_saved_position_is_named(tmp_path, monkeypatch):
    verdict = _prove(tmp_path, monkeypatch, lambda: (TinyModel(), ShuffledData()))
    assert (verdict.exact, verdict.step, verdict.sure) == (False, STOP, True)
    assert verdict.component in ("rng", "batch")  # its new iterator draws its order from the RNG first
    assert "train loader 0 could not have its position saved" in verdict.cause and "MyLoader" in verdict.cause


HAND_STEPPED: dict[str, torch.optim.lr_scheduler.LRScheduler] = {}


class HandSteppedModel(TinyModel):
    """Steps a StepLR by hand every batch, kept where no checkpoint and no walk reaches it."""

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        HAND_STEPPED["s"] = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return optimizer

    def on_train_batch_end(self, outputs, batch, batch_idx):
        HAND_STEPPED["s"].step()


def test_a_scheduler_stepped_by_hand_that_nobody_saves_is_the_learning_rate(tmp_path, monkeypatch):
    verdict = _prove(tmp_path, monkeypatch, lambda: (HandSteppedModel(), TinyData()))
    assert (verdict.exact, verdict.component, verdict.step, verdict.sure) == (False, "lr", STOP, True)
    assert "no LR scheduler is returned from configure_optimizers, yet the learning rate changes" in verdict.cause
    assert "ExactResume(state=" in verdict.fix and "configure_optimizers" in verdict.fix


class ScaledModel(TinyModel):
    """Scales its input by a non-persistent buffer that training changes by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(1), persistent=False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x * self.scale), y)
        self.scale.mul_(1.01)
        self.step_losses.append(loss.detach().clone())
        return loss


def test_a_hand_changed_non_persistent_buffer_is_named(tmp_path, monkeypatch):
    with pytest.warns(ExactResumeWarning, match="scale"):
        verdict = _prove(tmp_path, monkeypatch, lambda: (ScaledModel(), TinyData()))
    assert (verdict.exact, verdict.component, verdict.step, verdict.sure) == (False, "loss", STOP, True)
    assert "non-persistent buffer scale" in verdict.cause and "persistent=True" in verdict.fix
