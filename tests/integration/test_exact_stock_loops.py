"""Exact resume with the loop configurations users write with stock callbacks: ``max_steps`` or
``max_epochs``, a checkpoint at an epoch's end or mid-epoch, with and without validation, a validation
due right after the checkpoint, and ``StochasticWeightAveraging``.

Each case: an uninterrupted run A, the same run B SIGKILLed from outside, and C resuming B's
checkpoint in a fresh process. C's records (training losses and samples, and the epoch, step and loss
every validation batch saw) must continue A's bit for bit, its checkpoint file names must be A's, and
its final weights, optimizer and schedulers must equal A's. Controls check that the same kill and
resume without ``ExactResume`` differs where a case's claim depends on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_resume.format.read import load_file
from tests.helpers import kill_resume as h

# Outside `make test` (see tests/integration/conftest.py). The subset keeps both stops, both checkpoint
# kinds and validation once each, the default ModelCheckpoint, RetentionCheckpoint with mtbf, the
# validation epoch, SWA starting mid-epoch, the epoch-interval scheduler, the named hook and one control.
EXTENDED = frozenset(
    {
        "test_plain_lightning_differs[max_steps_epoch_end]",
        "test_stock_checkpoint_resumes_bit_for_bit[epoch_end_checkpoint-no_validation-max_steps]",
        "test_stock_checkpoint_resumes_bit_for_bit[epoch_end_checkpoint-no_validation-max_epochs]",
        "test_stock_checkpoint_resumes_bit_for_bit[epoch_end_checkpoint-validation_at_epoch_end-max_epochs]",
        "test_stock_checkpoint_resumes_bit_for_bit[mid_epoch_checkpoint-no_validation-max_steps]",
        "test_stock_checkpoint_resumes_bit_for_bit[mid_epoch_checkpoint-validation_at_epoch_end-max_steps]",
        "test_stock_checkpoint_resumes_bit_for_bit[mid_epoch_checkpoint-validation_at_epoch_end-max_epochs]",
        "test_epoch_interval_scheduler[epoch_end_checkpoint-max_steps]",
        "test_epoch_interval_scheduler[epoch_end_checkpoint-max_epochs]",
        "test_epoch_interval_scheduler[mid_epoch_checkpoint-max_epochs]",
        "test_validation_due_after_last_batch_save_sees_the_same_epoch[max_epochs]",
        "test_stochastic_weight_averaging[mid_epoch_swa_active]",
        "test_stochastic_weight_averaging[last_batch_before_swa_starts]",
        "test_plain_lightning_differs[validation_after_last_batch_save]",
    }
)

EPOCH = 12
"""Training batches per epoch (48 samples, batch size 4)."""

BASE = {
    "n": 4 * EPOCH,
    "batch_size": 4,
    "dropout": 0.2,
    "augment": True,
    "shuffle": True,
    "scheduler": True,
    "record_validation": True,
}
AT_EPOCH_END = {"every_n_epochs": 1, "save_top_k": -1, "save_last": True, "filename": "{epoch}-{step}"}
MID_EPOCH = {"every_n_train_steps": 5, "save_top_k": -1, "save_last": True, "filename": "{epoch}-{step}"}
STOPS = {"max_steps": {"max_steps": 2 * EPOCH + 6, "max_epochs": None}, "max_epochs": {"max_epochs": 3}}
VALIDATION = {"no_validation": {}, "validation_at_epoch_end": {"val_check_interval": 1.0}}
CHECKPOINTS = {"epoch_end_checkpoint": (AT_EPOCH_END, EPOCH + 3), "mid_epoch_checkpoint": (MID_EPOCH, EPOCH + 4)}
"""name: (ModelCheckpoint arguments, kill before this micro-batch)."""


def _three_runs(tmp_path: Path, cfg: dict[str, Any], pause: int, resume: str = "last") -> tuple[dict, dict]:
    """A, B killed before micro-batch ``pause``, C resuming; C's config records the step it resumed from."""
    a = h.uninterrupted(cfg, tmp_path)
    b = h.killed(cfg, tmp_path, pause)
    named = Path(b["ckpt_dir"]) / resume  # resume="last", or a file name in B's directory, or anything else: its newest
    newest = named if named.is_file() else _newest_checkpoint(Path(b["ckpt_dir"]))
    source = resume if resume == "last" else str(newest)
    c = h.resumed(cfg, tmp_path, b["ckpt_dir"], source, resumed_step=_step_of(newest), resumed_file=newest.name)
    return a, c


def _newest_checkpoint(ckpt_dir: Path) -> Path:
    return max(ckpt_dir.glob("*.ckpt"), key=_step_of)


def _step_of(ckpt: Path) -> int:
    return int(load_file(str(ckpt)).checkpoint["global_step"])


def assert_continues(a: dict[str, Any], c: dict[str, Any]) -> None:
    """C's records are A's after the checkpoint's step (validation records included), the final state is A's,
    and C's checkpoint directory holds A's file names (and the file C resumed from, which Lightning never deletes)."""
    a_rec, c_rec = h.steps(a["out"]), h.steps(c["out"])
    n = len(a_rec) - len(c_rec)
    trained_before = sum(1 for r in a_rec[:n] if "val" not in r)
    assert trained_before == c["resumed_step"], f"resumed after {trained_before} batches, not at the checkpoint"
    h.assert_exact_resume(a["out"], c["out"], resumed_after=None)
    for suffix in ("", "-monitor"):
        a_dir, c_dir = Path(a["ckpt_dir"] + suffix), Path(c["ckpt_dir"] + suffix)
        if a_dir.exists():
            a_names, c_names = {p.name for p in a_dir.iterdir()}, {p.name for p in c_dir.iterdir()}
            assert a_names <= c_names and c_names - a_names <= {c["resumed_file"]}, (sorted(a_names), sorted(c_names))


@pytest.mark.parametrize("stop", list(STOPS))
@pytest.mark.parametrize("validation", list(VALIDATION))
@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
def test_stock_checkpoint_resumes_bit_for_bit(tmp_path: Path, stop: str, validation: str, checkpoint: str) -> None:
    ckpt, pause = CHECKPOINTS[checkpoint]
    a, c = _three_runs(tmp_path, {**BASE, **STOPS[stop], **VALIDATION[validation], "ckpt": ckpt}, pause)
    assert_continues(a, c)


@pytest.mark.slow
@pytest.mark.parametrize("stop", list(STOPS))
@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
def test_epoch_interval_scheduler(tmp_path: Path, stop: str, checkpoint: str) -> None:
    """An LR schedule stepped once per epoch steps at the end of the resumed epoch, as in the uninterrupted run."""
    ckpt, pause = CHECKPOINTS[checkpoint]
    cfg = {**BASE, **STOPS[stop], "scheduler_interval": "epoch", "lr": 0.05, "ckpt": ckpt}
    a, c = _three_runs(tmp_path, cfg, pause)
    assert_continues(a, c)


def test_default_model_checkpoint_with_max_steps(tmp_path: Path) -> None:
    """``ModelCheckpoint()`` with no arguments saves at each epoch's end; resume from its file."""
    cfg = {**BASE, **STOPS["max_steps"], "ckpt": {}}
    a, c = _three_runs(tmp_path, cfg, EPOCH + 3, resume="newest")
    assert_continues(a, c)


def test_retention_epoch_end_save_with_mtbf_and_max_steps(tmp_path: Path) -> None:
    cfg = {
        **BASE,
        **STOPS["max_steps"],
        "retention": {"retention": {"keep_last": 3}},
        "exact_args": {"mtbf": "24h"},
        "safetensors": True,
    }
    a, c = _three_runs(tmp_path, cfg, EPOCH + 3)
    assert_continues(a, c)


VALIDATION_AFTER_LAST_BATCH_SAVE = {
    **BASE,
    "val_check_interval": 1.0,
    "ckpt": {**MID_EPOCH, "every_n_train_steps": EPOCH},
    "monitor_ckpt": {"monitor": "val_loss", "save_top_k": -1, "filename": "{epoch}-{step}-{val_loss:.4f}"},
}


@pytest.mark.parametrize("stop", list(STOPS))
def test_validation_due_after_last_batch_save_sees_the_same_epoch(tmp_path: Path, stop: str) -> None:
    """The validation due right after a save on an epoch's last batch runs on resume, with the epoch, step and
    checkpoint names of the uninterrupted run."""
    # from the last-batch save by its path: "last" would pick the monitored callback's newer file, written after
    # that validation (exact too, but then there is no validation left to run first)
    cfg = {**VALIDATION_AFTER_LAST_BATCH_SAVE, **STOPS[stop]}
    a, c = _three_runs(tmp_path, cfg, EPOCH + 2, resume="last.ckpt")
    assert any("val" in r for r in h.steps(c["out"])[:2]), "the due validation did not run first"
    assert_continues(a, c)


SWA = {"swa_lrs": 0.05, "swa_epoch_start": 2, "annealing_epochs": 2}
"""SWA from the second epoch (index 1) on, its LR annealed over two epochs."""
SWA_KILLS = {
    "mid_epoch_swa_starts": (MID_EPOCH, EPOCH + 4),
    "mid_epoch_swa_active": (MID_EPOCH, 2 * EPOCH + 4),
    "last_batch_before_swa_starts": ({**MID_EPOCH, "every_n_train_steps": EPOCH}, EPOCH + 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("kill", list(SWA_KILLS))
def test_stochastic_weight_averaging(tmp_path: Path, kill: str) -> None:
    """SWA installs its LR schedule in ``on_train_epoch_start``, which Lightning skips on a restart inside an
    epoch; it is replayed (or, after a save on an epoch's last batch, run for the first time)."""
    ckpt, pause = SWA_KILLS[kill]
    cfg = {**BASE, "max_epochs": 4, "scheduler": False, "swa": SWA, "ckpt": ckpt}
    a, c = _three_runs(tmp_path, cfg, pause)
    assert_continues(a, c)


def test_epoch_start_hook_not_replayed_is_named(tmp_path: Path) -> None:
    """A user callback's ``on_train_epoch_start`` is not called twice on a mid-epoch resume; a warning names it."""
    cfg = {**BASE, "max_epochs": 2, "ckpt": MID_EPOCH, "epoch_start_counter": True}
    a, c = _three_runs(tmp_path, cfg, EPOCH + 4)
    assert_continues(a, c)
    output = (Path(c["out"]) / "stdout.txt").read_text()
    assert "are not re-run: EpochStartCounter.on_train_epoch_start" in output


@pytest.mark.parametrize(
    "cfg, pause",
    [
        ({**BASE, **STOPS["max_steps"], "ckpt": AT_EPOCH_END}, EPOCH + 3),
        ({**VALIDATION_AFTER_LAST_BATCH_SAVE, **STOPS["max_epochs"]}, EPOCH + 2),
    ],
    ids=["max_steps_epoch_end", "validation_after_last_batch_save"],
)
def test_plain_lightning_differs(tmp_path: Path, cfg: dict[str, Any], pause: int) -> None:
    """The controls: the same kill and resume without ExactResume does not continue the uninterrupted run."""
    a, c = _three_runs(tmp_path, {**cfg, "exact": False}, pause)
    with pytest.raises(AssertionError):
        assert_continues(a, c)
