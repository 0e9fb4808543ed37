"""A resumed run writes the same checkpoint files as the uninterrupted one (issue 23.3).

Lightning's checkpoints do not hold the logged metrics a checkpoint callback's save decision reads, and a
resumed ``fit`` starts with none: a monitored save due before the next validation was skipped, so a file
the uninterrupted run writes never appeared and the best-k list differed. ``ExactResume`` saves
``trainer.callback_metrics`` and puts them back. Run A trains 24 steps; run B stops at step 9 (its newest
file is the step-9 one, as a kill after it would leave) and C resumes B's directory with ``ckpt_path="last"``.
Validation runs at each epoch end (8 batches), saves every 3 steps: the step-12 save reads the metric of step 8.
"""

from __future__ import annotations

import lightning
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_resume import ExactResume, RetentionCheckpoint
from tests.helpers.filesystem import listing
from tests.helpers.models import TinyData, TinyModel, tiny_trainer

pytestmark = pytest.mark.timeout(300)

CALLBACKS = {
    "monitored ModelCheckpoint": lambda d: ModelCheckpoint(
        dirpath=d, monitor="val/loss", every_n_train_steps=3, save_top_k=2, filename="{step}"
    ),
    "unmonitored ModelCheckpoint": lambda d: ModelCheckpoint(dirpath=d, every_n_train_steps=3, filename="{step}"),
    "RetentionCheckpoint": lambda d: RetentionCheckpoint(
        dirpath=d, monitor="val/loss", every_n_train_steps=3, keep_last=1, keep_best=2
    ),
}


class Saves(Callback):
    """The step of every checkpoint the run writes (files later pruned included)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.steps.append(trainer.global_step)


def _fit(callback, max_steps: int, ckpt_path=None):
    lightning.seed_everything(0, verbose=False)
    saves = Saves()
    trainer = tiny_trainer([ExactResume(mtbf=None), callback, saves], max_steps=max_steps)
    model = TinyModel()
    trainer.fit(model, datamodule=TinyData(), ckpt_path=ckpt_path)
    return trainer, model, saves.steps


def _best(callback) -> dict:
    return {p.rsplit("/", 1)[-1]: float(v) for p, v in callback.best_k_models.items()}


@pytest.mark.parametrize("kind", list(CALLBACKS))
def test_the_resumed_run_writes_the_files_the_uninterrupted_run_writes(tmp_path, kind):
    a_dir, b_dir = str(tmp_path / "A"), str(tmp_path / "B")
    a_callback = CALLBACKS[kind](a_dir)
    _, a_model, a_saves = _fit(a_callback, 24)
    _fit(CALLBACKS[kind](b_dir), 9)
    assert listing(b_dir)[-1] in ("step=9.ckpt", "step=000000009.ckpt")
    resume_source = listing(b_dir)[-1]
    c_callback = CALLBACKS[kind](b_dir)
    c_trainer, c_model, c_saves = _fit(c_callback, 24, ckpt_path="last")
    assert c_trainer.callbacks[0].resume_report["source"].endswith(resume_source)
    assert c_saves == [step for step in a_saves if step > 9]  # the same saves at the same steps
    # the file resumed from is never deleted by the resumed run (Lightning's rule and ours); else the same files
    assert sorted(set(listing(b_dir)) - {resume_source}) == sorted(set(listing(a_dir)) - {resume_source})
    assert _best(c_callback) == _best(a_callback)
    assert torch.equal(torch.stack(c_model.step_losses), torch.stack(a_model.step_losses[9:]))
