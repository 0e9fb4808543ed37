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
- ``self.log(..., on_epoch=True)`` in ``training_step`` (mean, max, sum; with ``sync_dist`` under DDP): a resumed
  epoch's value covered the resumed batches only, and the plateau scheduler and best-k checkpoint monitoring it
  decided on that; after a save on an epoch's last batch or in its end hooks the epoch's row was never logged.
  Every row the logger got after the save is compared, as float bits.
- A save at the end of the validation that ends an epoch (``val_check_interval=0.5``, ``check_val_every_n_epoch=2``,
  an interval in batches): the resumed run's next epoch had another sample order while the report said exact.
- ``CombinedLoader(mode="max_size_cycle")`` of loaders without a length: the resumed epoch ran on until every loader
  had run out again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lightning_resume.format.read import load_file
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
        "test_plateau_scheduler[step_on_step_and_epoch_loss-save_on_last_batch]",
        "test_epoch_metrics[save_on_last_batch]",
        "test_epoch_metrics[save_at_epoch_end_max_steps]",
        "test_epoch_metrics[ddp_sync_dist]",
        "test_epoch_metrics[metric_object_mid_epoch]",
        "test_validation_ending_an_epoch[check_val_every_2_epochs]",
        "test_validation_ending_an_epoch[every_4_batches]",
        "test_validation_ending_an_epoch[every_8_batches_across_epochs]",
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
    # logged per step and per epoch: callback_metrics["train_loss"] is the step's value until the epoch's end; any
    # improvement counts, so the saved batch's step decides on that value (its loss is the epoch's lowest so far)
    "step_on_step_and_epoch_loss": {
        **PLATEAU, "scheduler_interval": "step", "monitor": "train_loss", "log_train_loss": "both", "max_epochs": 2,
        "plateau_threshold": 1e-4,
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


def assert_same_run_and_files(a: dict[str, Any], c: dict[str, Any], ranks: int = 1) -> None:
    """C continues A bit for bit (losses, samples, LRs, final state), and writes A's checkpoint files: the same
    names, steps and callback states; C's directory may also hold the file it resumed from. With a second, monitored
    checkpoint callback (``monitor_ckpt``), its directory too."""
    h.assert_exact_resume(a["out"], c["out"], resumed_after=None, ranks=ranks)
    suffixes = [""] + (["-monitor"] if a.get("monitor_ckpt") else [])
    for suffix in suffixes:
        a_files, c_files = checkpoint_files(a["ckpt_dir"] + suffix), checkpoint_files(c["ckpt_dir"] + suffix)
        extra = set(c_files) - set(a_files)  # at most the file resumed from, which Lightning never deletes
        assert a_files and set(a_files) <= set(c_files) and len(extra) <= 1, (sorted(a_files), sorted(c_files))
        for name, inside in a_files.items():
            assert c_files[name] == inside, f"{name}:\n uninterrupted {inside}\n resumed       {c_files[name]}"


def resumed_step(c: dict[str, Any]) -> int:
    """The global step C resumed at (its report's; the file it resumed from may be rewritten since, as ``last``)."""
    return int(json.loads((Path(c["out"]) / "report-rank0.json").read_text())["step"])


def logged_rows(out: str) -> list[dict[str, Any]]:
    """The rows the trainee's logger got (``record_metrics``), in order, each value as ``float.hex``."""
    path = Path(out) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def assert_same_logged_rows(a: dict[str, Any], c: dict[str, Any]) -> None:
    """C logged what A logged after the checkpoint C resumed from, bit for bit: its rows are A's last ones, and
    among them the row of every epoch from the saved one on (``samples`` marks the epoch rows of the trainee's
    ``log_epoch_extremes``): the saved epoch's, whose end came after the save, is not left out."""
    a_rows, c_rows = logged_rows(a["out"]), logged_rows(c["out"])
    assert c_rows, "the resumed run logged nothing"
    assert c_rows == a_rows[len(a_rows) - len(c_rows) :], "\n".join(
        f" uninterrupted {x}\n resumed       {y}" for x, y in zip(a_rows[len(a_rows) - len(c_rows) :], c_rows) if x != y
    )
    saved_epoch = (resumed_step(c) - 1) // EPOCH  # the epoch of the last batch trained before the save
    epoch_rows = lambda rows: [r for r in rows if "samples" in r]
    expected = [r for r in epoch_rows(a_rows) if float.fromhex(r["epoch"]) >= saved_epoch]
    assert expected and epoch_rows(c_rows) == expected, (saved_epoch, epoch_rows(c_rows), expected)


PLATEAU_CASES = [
    ("epoch_on_validation", "mid_epoch"),
    ("epoch_on_validation", "save_on_last_batch"),
    ("epoch_on_validation", "save_at_validation_end_max_steps"),
    ("epoch_on_training_loss", "save_at_epoch_end_max_steps"),
    ("step_on_training_loss", "mid_epoch"),
    ("step_on_step_and_epoch_loss", "save_on_last_batch"),
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
    # loaders without a length: the epoch ends when the long one runs out, the short one cycled since batch 5
    "max_size_cycle_without_length": {"combined": {**COMBINED, "mode": "max_size_cycle", "iterable": True}},
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


EPOCH_METRICS = {**BASE, "record_metrics": True, "log_train_loss": "both", "log_epoch_extremes": True}
"""``train_loss`` logged per step and per epoch (mean), ``train_loss_max`` (max) and ``samples`` (sum) per epoch;
every row the logger gets recorded."""
ON_TRAIN_LOSS = {**EPOCH_METRICS, "scheduler": "plateau", "lr": 0.05, "monitor": "train_loss"}
"""A plateau scheduler on the epoch's mean training loss (``callback_metrics["train_loss"]`` at the epoch's end)."""
BEST_TWO_EPOCHS = {"monitor": "train_loss_epoch", "save_top_k": 2, "filename": "{epoch}-{step}-{train_loss_epoch}"}
"""A second checkpoint callback keeping the two epochs of least training loss, saved in ``on_train_epoch_end``."""
EPOCH_METRIC_CASES = {
    # resumed at step 15, inside the second epoch
    "mid_epoch": ({**ON_TRAIN_LOSS, "max_epochs": 3, "ckpt": MID_EPOCH, "monitor_ckpt": BEST_TWO_EPOCHS}, EPOCH + 4),
    # saved in on_train_batch_end of the first epoch's last batch: Lightning counts the epoch finished on resume
    "save_on_last_batch": (
        {**ON_TRAIN_LOSS, "max_epochs": 3, "ckpt": {**MID_EPOCH, "every_n_train_steps": EPOCH}}, EPOCH + 2
    ),
    # saved in on_train_epoch_end (no validation), the run bounded by max_steps
    "save_at_epoch_end_max_steps": (
        {**ON_TRAIN_LOSS, "max_epochs": None, "max_steps": 3 * EPOCH, "ckpt": AT_EPOCH_END}, EPOCH + 2
    ),
    # a torchmetrics MeanMetric logged as an object too (its state is ExactResume's user state, Lightning's entry
    # for it is put back): mid-epoch, and saved in on_train_epoch_end, before Lightning computes and resets it
    "metric_object_mid_epoch": (
        {**ON_TRAIN_LOSS, "log_metric_object": True, "max_epochs": 3, "ckpt": MID_EPOCH}, EPOCH + 4
    ),
    "metric_object_at_epoch_end": (
        {**ON_TRAIN_LOSS, "log_metric_object": True, "max_epochs": None, "max_steps": 3 * EPOCH, "ckpt": AT_EPOCH_END},
        EPOCH + 2,
    ),
    # two ranks, each accumulating its own part of the epoch, synchronized at the epoch's end
    "ddp_sync_dist": ({**EPOCH_METRICS, "devices": 2, "n": 8 * EPOCH, "sync_dist": True, "ckpt": MID_EPOCH}, EPOCH + 4),
}  # fmt: skip
"""name: (config, kill before this micro-batch)."""


@pytest.mark.parametrize("case", list(EPOCH_METRIC_CASES))
def test_epoch_metrics(tmp_path: Path, case: str) -> None:
    cfg, pause = EPOCH_METRIC_CASES[case]
    a, c = h.three_runs(cfg, tmp_path, pause)
    assert_same_run_and_files(a, c, ranks=cfg.get("devices", 1))
    assert_same_logged_rows(a, c)


VALIDATION_ENDING_AN_EPOCH = {
    # validation twice an epoch; the top-2 checkpoint on val_loss saved at the end of the one after batch 12
    "val_check_interval_half": ({"val_check_interval": 0.5, "max_epochs": 3}, EPOCH + 4),
    # validation at the end of every second epoch only: saved after batch 24
    "check_val_every_2_epochs": ({"val_check_interval": 1.0, "check_val_every_n_epoch": 2, "max_epochs": 4}, 26),
    # validation every 4 batches of an epoch: saved after batch 12, among others
    "every_4_batches": ({"val_check_interval": 4, "max_epochs": 3}, EPOCH + 2),
    # validation every 8 batches counted across epochs: the one after batch 24 ends the second epoch
    "every_8_batches_across_epochs": (
        {"val_check_interval": 8, "check_val_every_n_epoch": None, "max_epochs": 3}, 2 * EPOCH + 2
    ),
}  # fmt: skip
"""name: (config, kill before this micro-batch); each resumes from the save at the validation ending an epoch."""


@pytest.mark.parametrize("case", list(VALIDATION_ENDING_AN_EPOCH))
def test_validation_ending_an_epoch(tmp_path: Path, case: str) -> None:
    extra, pause = VALIDATION_ENDING_AN_EPOCH[case]
    cfg = {**EPOCH_METRICS, "ckpt": {"monitor": "val_loss", "save_top_k": 2, "filename": "{epoch}-{step}"}, **extra}
    a, c = h.three_runs(cfg, tmp_path, pause)
    assert resumed_step(c) % EPOCH == 0, f"resumed at step {resumed_step(c)}, not after an epoch's last batch"
    assert_same_run_and_files(a, c)
    assert_same_logged_rows(a, c)
