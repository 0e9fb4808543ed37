"""The exactness contract, for real: run A uninterrupted; run B, SIGKILLed from outside at a chosen
point; run C, a fresh process resuming B's checkpoint with ``fit(ckpt_path="last")``. C's per-step
losses (float bits), samples and final weights/optimizer/scheduler state must equal A's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.helpers import kill_resume as h

# Outside `make test` (see tests/integration/conftest.py); DDP resume stays covered there by
# test_exact_stock_data, the controls by test_exact_stock_loops.
EXTENDED = frozenset(
    {
        "test_killed_run_resumes_bit_for_bit[mid_epoch]",
        "test_killed_run_resumes_bit_for_bit[last_batch_of_epoch]",
        "test_killed_run_resumes_bit_for_bit[validation_due_at_save]",
        "test_killed_run_resumes_bit_for_bit[validation_due_at_epoch_end_save]",
        "test_killed_run_resumes_bit_for_bit[safetensors_io_iterable]",
        "test_killed_run_resumes_bit_for_bit[workers2_accumulate_validation_epoch_end]",
        "test_ddp_two_processes_resume_bit_for_bit",
        "test_plain_lightning_resume_differs",
    }
)

EVERY_3 = {"every_n_train_steps": 3, "save_top_k": -1, "save_last": True, "filename": "{step}"}
EVERY_5 = {"every_n_train_steps": 5, "save_top_k": -1, "save_last": True, "filename": "{step}"}
BASE = {"n": 40, "batch_size": 4, "max_epochs": 2, "dropout": 0.2, "augment": True, "shuffle": True, "ckpt": EVERY_3}

# name: (config overrides, pause before micro-batch k, micro-batches trained before the checkpoint)
CASES = {
    "mid_epoch": ({}, 7, 6),
    "mid_epoch_workers2": ({"num_workers": 2}, 7, 6),
    "last_batch_of_epoch": ({"ckpt": EVERY_5, "max_epochs": 3}, 10, 10),
    "after_epoch_end_save": (
        {"ckpt": {"every_n_epochs": 1, "save_on_train_epoch_end": True, "save_top_k": -1, "save_last": True}},
        12,
        10,
    ),
    "validation_due_at_save": ({"val_check_interval": 3}, 7, 6),
    "validation_due_at_epoch_end_save": ({"val_check_interval": 5, "ckpt": EVERY_5, "max_epochs": 3}, 10, 10),
    "accumulate_step_scheduler_bf16": ({"accumulate": 2, "scheduler": True, "precision": "bf16-mixed"}, 9, 6),
    "iterable_without_len": ({"iterable": True}, 7, 6),
    "safetensors_io_iterable": ({"iterable": True, "safetensors": True, "scheduler": True}, 7, 6),
    "safetensors_async_io": (
        {"safetensors": True, "async": True, "scheduler": True, "ckpt": {**EVERY_3, "every_n_train_steps": 2}},
        7,
        6,
    ),
    "safetensors_io_workers2_validation": ({"num_workers": 2, "val_check_interval": 3, "safetensors": True}, 7, 6),
    "scheduled_snapshots_through_retention": (
        {
            "retention": {"retention": {"keep_last": 2}},
            "exact_args": {"schedule": {"every_n_train_steps_max": 3}},
            "safetensors": True,
        },
        7,
        6,
    ),
    "workers2_accumulate_validation_epoch_end": (
        {"num_workers": 2, "accumulate": 3, "val_check_interval": 3, "ckpt": {**EVERY_3, "every_n_train_steps": 1}},
        11,
        10,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_killed_run_resumes_bit_for_bit(tmp_path: Path, case: str) -> None:
    overrides, pause, resumed_after = CASES[case]
    a, c = h.three_runs({**BASE, **overrides}, tmp_path, pause)
    # every save compared too: under accumulation a resume used to save its resume step once more
    h.assert_exact_resume(a["out"], c["out"], resumed_after, compare_saves=True)


@pytest.mark.slow
def test_ddp_two_processes_resume_bit_for_bit(tmp_path: Path) -> None:
    cfg = {**BASE, "devices": 2, "n": 48}
    a, c = h.three_runs(cfg, tmp_path, 5)
    h.assert_exact_resume(a["out"], c["out"], resumed_after=3, ranks=2)
    # Each rank keeps its own data shard and RNG: within an epoch the ranks train disjoint samples.
    h.assert_ranks_disjoint(a["out"], epoch=0)


def test_plain_lightning_resume_differs(tmp_path: Path) -> None:
    """The control: without ExactResume the same kill and resume does not reproduce the losses."""
    a, c = h.three_runs({**BASE, "exact": False}, tmp_path, 7)
    with pytest.raises(AssertionError, match="differs"):
        h.assert_exact_resume(a["out"], c["out"], 6)


def test_sigkill_at_a_random_moment(tmp_path: Path) -> None:
    """Test recovery before you need it: kill at a random step once a checkpoint exists, resume, compare."""
    cfg = {**BASE, "ckpt": {**EVERY_3, "every_n_train_steps": 2}, "max_epochs": 3}
    a = h.uninterrupted(cfg, tmp_path)
    b = dict(cfg, out=str(tmp_path / "B"), ckpt_dir=str(tmp_path / "B" / "ckpt"))
    target = random.Random().randint(3, 25)
    last = Path(b["ckpt_dir"]) / "last.ckpt"
    h.run_and_kill_when(b, tmp_path, lambda: last.exists() and len(h.steps(b["out"])) >= target)
    # "last" is the newest checkpoint: a kill between a step file and last.ckpt leaves the step file newer
    saved_step = max(torch.load(p, weights_only=True)["global_step"] for p in Path(b["ckpt_dir"]).glob("*.ckpt"))
    c = h.resumed(cfg, tmp_path, b["ckpt_dir"])
    h.assert_exact_resume(a["out"], c["out"], resumed_after=saved_step)
