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

from lightning_resume import ExactResume, RetentionCheckpoint, RetentionPolicy, ScheduleOptions
from tests.helpers.filesystem import listing
from tests.helpers.models import TinyData, TinyModel, tiny_trainer

pytestmark = pytest.mark.timeout(300)

CALLBACKS = {
    "monitored ModelCheckpoint": lambda d: ModelCheckpoint(
        dirpath=d, monitor="val/loss", every_n_train_steps=3, save_top_k=2, filename="{step}"
    ),
    "unmonitored ModelCheckpoint": lambda d: ModelCheckpoint(dirpath=d, every_n_train_steps=3, filename="{step}"),
    "RetentionCheckpoint": lambda d: RetentionCheckpoint(
        dirpath=d, monitor="val/loss", every_n_train_steps=3, retention=RetentionPolicy(keep_last=1, keep_best=2)
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
    assert c_trainer.callbacks[0].resume_report.source.endswith(resume_source)
    assert c_saves == [step for step in a_saves if step > 9]  # the same saves at the same steps
    # the file resumed from is never deleted by the resumed run (Lightning's rule and ours); else the same files
    assert sorted(set(listing(b_dir)) - {resume_source}) == sorted(set(listing(a_dir)) - {resume_source})
    assert _best(c_callback) == _best(a_callback)
    assert torch.equal(torch.stack(c_model.step_losses), torch.stack(a_model.step_losses[9:]))


def _fit_with_snapshots(callbacks, max_steps: int, ckpt_path=None):
    """A fit whose snapshot schedule fires every 5 steps, beside the user's checkpoint callback."""
    lightning.seed_everything(0, verbose=False)
    trainer = tiny_trainer([*callbacks[:-1], ExactResume(mtbf=None, schedule=ScheduleOptions(every_n_train_steps_max=5)), callbacks[-1]],
                           max_steps=max_steps)  # fmt: skip
    trainer.fit(TinyModel(), datamodule=TinyData(), ckpt_path=ckpt_path)
    return trainer


def _user_checkpoint(d):
    return ModelCheckpoint(dirpath=d, every_n_train_steps=3, filename="{step}", save_top_k=-1)


def test_scheduled_snapshots_leave_no_file_the_uninterrupted_run_lacks(tmp_path):
    """Snapshots come at steps the schedule chose (5, 10, ... in A; 5 in B, then counted anew by C): each is
    removed once the next is durable, and the last at the clean end, when the user's step-24 file holds a newer
    state. The directories end as they would without ExactResume."""
    a_dir, b_dir = str(tmp_path / "A"), str(tmp_path / "B")
    _fit_with_snapshots([_user_checkpoint(a_dir)], 24)
    _fit_with_snapshots([_user_checkpoint(b_dir)], 9)
    _fit_with_snapshots([_user_checkpoint(b_dir)], 24, ckpt_path="last")
    assert listing(a_dir) == listing(b_dir) == [f"step={s}.ckpt" for s in sorted(range(3, 25, 3), key=str)]


class Corrupts(Callback):
    """At the end of training, before ExactResume's hook: truncates the user's newest checkpoint."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        with open(self.path, "r+b") as f:
            f.truncate(100)


def test_only_snapshots_we_wrote_are_removed_and_never_for_an_unverified_checkpoint(tmp_path):
    """A file named like a snapshot that the file itself does not prove we wrote stays; a snapshot stays when
    the user's checkpoint that would supersede it does not verify (it is then the newest good state)."""
    d = tmp_path / "ckpt"
    d.mkdir()
    foreign = d / "last-snapshot-step=000000001.ckpt"
    torch.save({"state_dict": {}, "global_step": 1}, foreign)
    _fit_with_snapshots([_user_checkpoint(str(d))], 12)  # snapshots at 5 and 10; the user's newest at 12
    assert foreign.exists() and not [n for n in listing(str(d)) if n.startswith("last-snapshot") and n != foreign.name]

    e = tmp_path / "corrupt"
    _fit_with_snapshots([Corrupts(str(e / "step=12.ckpt")), _user_checkpoint(str(e))], 12)
    assert "last-snapshot-step=000000010.ckpt" in listing(str(e))  # step 12's file is truncated: 10 stays
