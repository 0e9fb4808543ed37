"""Lightning's own resume gaps, compensated by ``ExactResume`` (issue 39), killed for real.

Each case: an uninterrupted run A, the same run B SIGKILLed from outside, and C resuming B's "last" in a fresh
process. C's micro-batches (samples, loss bits, the learning rate each step trained with) continue A's, the
final weights, optimizer and scheduler states are A's, and C's checkpoint directory holds A's files, with the
step and the checkpoint callback's state (best-k list, last file) inside each equal to A's.

- ``ReduceLROnPlateau`` (``interval="epoch"`` on a validation loss, ``"step"`` on a training loss): Lightning
  skips its step at the end of a resumed epoch, and those of the saved batch or epoch, which come after the
  save; the LR then differed from the next epoch (step) on.
- ``CombinedLoader`` of two shuffled loaders of unequal lengths: in ``max_size`` mode a loader exhausted before
  the save yielded its next epoch's batches after the resume.
- ``ModelCheckpoint(save_last=True)``: a resumed run with nothing left to save rewrote ``last.ckpt`` at train end
  at the final step, which the uninterrupted run never wrote.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_resume.io.read import load_file
from tests.helpers import kill_resume as h

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

EXTENDED = frozenset(
    {
        "test_plateau_scheduler[epoch_on_validation-save_on_last_batch]",
        "test_plateau_scheduler[epoch_on_validation-save_at_validation_end_max_steps]",
        "test_plateau_scheduler[epoch_on_training_loss-save_at_epoch_end_max_steps]",
        "test_combined_loader[max_size_cycle]",
        "test_combined_loader[min_size]",
        "test_combined_loader[max_size_plain_workers]",
        "test_last_checkpoint_file[epoch_end_saves]",
        "test_last_checkpoint_file[top_k_on_validation]",
    }
)

EPOCH = 12
"""Training batches per epoch (48 samples, batch size 4)."""

BASE = {"n": 4 * EPOCH, "batch_size": 4, "dropout": 0.2, "augment": True, "shuffle": True, "record_lr": True}
MID_EPOCH = {"every_n_train_steps": 5, "save_top_k": -1, "save_last": True, "filename": "{epoch}-{step}"}
AT_EPOCH_END = {"every_n_epochs": 1, "save_top_k": -1, "save_last": True, "filename": "{epoch}-{step}"}

PLATEAU = {**BASE, "scheduler": "plateau", "lr": 0.05}
PLATEAUS = {
    "epoch_on_validation": {**PLATEAU, "val_check_interval": 1.0, "max_epochs": 4},
    "epoch_on_training_loss": {**PLATEAU, "monitor": "train_loss", "log_train_loss": "epoch", "max_epochs": 4},
    "step_on_training_loss": {
        **PLATEAU, "scheduler_interval": "step", "monitor": "train_loss", "log_train_loss": "step", "max_epochs": 2
    },
}  # fmt: skip
PLATEAU_KILLS = {
    "mid_epoch": ({"ckpt": MID_EPOCH}, EPOCH + 4),
    # saved in on_train_batch_end of an epoch's last batch, with its validation still due
    "save_on_last_batch": ({"ckpt": {**MID_EPOCH, "every_n_train_steps": EPOCH}}, EPOCH + 2),
    # saved at the end of the validation of an epoch's last batch, the run bounded by max_steps
    "save_at_validation_end_max_steps": ({"ckpt": AT_EPOCH_END, "max_epochs": None, "max_steps": 3 * EPOCH}, EPOCH + 2),
    # saved in on_train_epoch_end (no validation), the run bounded by max_steps
    "save_at_epoch_end_max_steps": ({"ckpt": AT_EPOCH_END, "max_epochs": None, "max_steps": 3 * EPOCH}, EPOCH + 2),
}
"""name: (config, kill before this micro-batch)."""


def checkpoint_files(ckpt_dir: str) -> dict[str, Any]:
    """Each checkpoint file's name -> its global step and every ``ModelCheckpoint``'s state inside it, paths by
    file name (A's and C's directories differ)."""
    out = {}
    for path in sorted(Path(ckpt_dir).glob("*.ckpt")):
        checkpoint = load_file(str(path)).checkpoint
        callbacks = {
            key: {
                "best_k_models": {Path(p).name: float(v) for p, v in state["best_k_models"].items()},
                "best_model_path": Path(state["best_model_path"]).name,
                "last_model_path": Path(state["last_model_path"]).name,
                "kth_value": float(state["kth_value"]),
            }
            for key, state in checkpoint["callbacks"].items()
            if key.startswith("ModelCheckpoint")
        }
        out[path.name] = {"global_step": checkpoint["global_step"], "callbacks": callbacks}
    return out


def assert_same_run_and_files(a: dict[str, Any], c: dict[str, Any]) -> None:
    """C continues A bit for bit (losses, samples, LRs, final state), and writes A's checkpoint files: the same
    names, steps and callback states; C's directory may also hold the file it resumed from."""
    h.assert_exact_resume(a["out"], c["out"], resumed_after=None)
    a_files, c_files = checkpoint_files(a["ckpt_dir"]), checkpoint_files(c["ckpt_dir"])
    extra = set(c_files) - set(a_files)  # at most the file resumed from, which Lightning never deletes
    assert set(a_files) <= set(c_files) and len(extra) <= 1, (sorted(a_files), sorted(c_files))
    for name, inside in a_files.items():
        assert c_files[name] == inside, f"{name}:\n uninterrupted {inside}\n resumed       {c_files[name]}"


PLATEAU_CASES = [
    ("epoch_on_validation", "mid_epoch"),
    ("epoch_on_validation", "save_on_last_batch"),
    ("epoch_on_validation", "save_at_validation_end_max_steps"),
    ("epoch_on_training_loss", "save_at_epoch_end_max_steps"),
    ("step_on_training_loss", "mid_epoch"),
]


@pytest.mark.parametrize("plateau, kill", PLATEAU_CASES, ids=[f"{p}-{k}" for p, k in PLATEAU_CASES])
def test_plateau_scheduler(tmp_path: Path, plateau: str, kill: str) -> None:
    extra, pause = PLATEAU_KILLS[kill]
    a, c = h.three_runs({**PLATEAUS[plateau], **extra}, tmp_path, pause)
    assert_same_run_and_files(a, c)


COMBINED = {"sizes": {"long": 4 * EPOCH, "short": 20}}
"""Two shuffled loaders, 12 and 5 batches: the short one is exhausted (or cycled) at the kill."""
COMBINED_MODES = {
    "max_size": {"combined": {**COMBINED, "mode": "max_size"}},
    "max_size_cycle": {"combined": {**COMBINED, "mode": "max_size_cycle"}},
    "min_size": {"combined": {**COMBINED, "mode": "min_size"}, "max_epochs": 4},
    "max_size_plain_workers": {"combined": {**COMBINED, "mode": "max_size"}, "pipeline": "plain", "num_workers": 1},
}


@pytest.mark.parametrize("mode", list(COMBINED_MODES))
def test_combined_loader(tmp_path: Path, mode: str) -> None:
    cfg = {**BASE, "max_epochs": 2, "ckpt": MID_EPOCH, **COMBINED_MODES[mode]}
    a, c = h.three_runs(cfg, tmp_path, pause=EPOCH)  # from step 10: the short loader ran out at batch 5
    assert_same_run_and_files(a, c)


LAST_FILES = {
    # the last save at step 30, three steps before max_steps: nothing left to save after the resume
    "every_n_train_steps": ({"every_n_train_steps": 5, "save_last": True}, 31),
    "epoch_end_saves": ({"save_last": True}, 2 * EPOCH + 2),
    "top_k_on_validation": ({"monitor": "val_loss", "save_top_k": 2, "save_last": True}, 2 * EPOCH + 2),
}


@pytest.mark.parametrize("checkpoint", list(LAST_FILES))
def test_last_checkpoint_file(tmp_path: Path, checkpoint: str) -> None:
    ckpt, pause = LAST_FILES[checkpoint]
    cfg = {**BASE, "ckpt": ckpt, "max_epochs": None, "max_steps": 2 * EPOCH + 9, "val_check_interval": 1.0}
    a, c = h.three_runs(cfg, tmp_path, pause)
    assert_same_run_and_files(a, c)
