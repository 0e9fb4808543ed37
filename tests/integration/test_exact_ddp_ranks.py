"""Exact resume of DDP with more than two ranks (gloo, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import kill_resume as h

EXTENDED: frozenset = frozenset()


def _cfg(ranks: int) -> dict:
    return {
        "n": 40 * ranks, "batch_size": 4, "max_epochs": 2, "dropout": 0.2, "augment": True, "shuffle": True,
        "devices": ranks, "safetensors": True, "ckpt": {"save_top_k": 0},
        "exact_args": {"schedule": {"every_n_train_steps_max": 6}},
    }  # fmt: skip


@pytest.mark.parametrize("ranks", [3, 4])
def test_ddp_resumes_bit_for_bit(tmp_path: Path, ranks: int) -> None:
    a, c = h.three_runs(_cfg(ranks), tmp_path, 9)
    h.assert_exact_resume(a["out"], c["out"], 6, ranks=ranks)
