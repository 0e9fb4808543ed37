"""Exact resume of DDP on more than two ranks (gloo, CPU): a real SIGKILL and a fresh process.

DDP all-reduces the gradients in buckets it lays out again after its first backward; a resumed process starts
from the first layout, and with three or more ranks the all-reduce then sums some gradients in another order
(one ulp off at the first resumed step). Two ranks are immune (a + b == b + a), which is why the 2-rank tests
never saw it. Each case: run A uninterrupted, run B SIGKILLed between durable snapshots, run C resuming B's last;
every rank's loss bits, final state and ``prove``'s per-step weights equal A's. The early cases resume from a
snapshot taken before DDP rebuilt its buckets (step 1: the rebuild is pending) or before its logger recorded
the rebuilt layout (step 2).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import kill_resume as h

EXTENDED = frozenset(
    {
        "test_ddp_on_more_than_two_ranks_resumes_bit_for_bit[4_ranks]",
        "test_ddp_on_more_than_two_ranks_resumes_bit_for_bit[3_ranks_from_step_1]",
        "test_ddp_on_more_than_two_ranks_resumes_bit_for_bit[3_ranks_from_step_2]",
    }
)

# name: (ranks, durable snapshot every n steps, pause before micro-batch k, micro-batches trained before it)
CASES = {
    "3_ranks": (3, 6, 9, 6),
    "4_ranks": (4, 6, 9, 6),
    "3_ranks_from_step_1": (3, 1, 1, 1),
    "3_ranks_from_step_2": (3, 2, 2, 2),
}


def _cfg(ranks: int, every: int) -> dict:
    """One epoch of 10 steps per rank: shuffled, augmented, dropout; snapshots only (ExactResume's schedule)."""
    return {
        "n": 40 * ranks, "batch_size": 4, "max_epochs": 1, "dropout": 0.2, "augment": True, "shuffle": True,
        "devices": ranks, "safetensors": True, "ckpt": {"save_top_k": 0},
        "exact_args": {"schedule": {"every_n_train_steps_max": every}},
    }  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_ddp_on_more_than_two_ranks_resumes_bit_for_bit(tmp_path: Path, case: str) -> None:
    ranks, every, pause, resumed_after = CASES[case]
    a, c = h.three_runs(_cfg(ranks, every), tmp_path, pause)
    h.assert_exact_resume(a["out"], c["out"], resumed_after, ranks=ranks)
    assert "will not be exact" not in h.output(c, tail=None)
