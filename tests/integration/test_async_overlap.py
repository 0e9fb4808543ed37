"""Overlapped snapshot copies (``SafetensorsCheckpointIO(save="overlapped")``) under a real
kill: run A uninterrupted, B SIGKILLed, C resumed in a fresh process; C continues A bit for bit.

Each case edits every weight in place at every batch start (``EditWeights``: between each save and the next
optimizer step, not idempotent) while the deferred copy is held back on its helper thread (``slow_copy``),
so the copy-on-write guard must save each weight as it was at the save; the runs report how many it copied.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import kill_resume as h

EXTENDED = frozenset(
    {
        "test_overlapped_copy_resumes_bit_for_bit[bf16_scheduler]",
        "test_overlapped_copy_resumes_bit_for_bit[manual_two_optimizers]",
    }
)

EVERY_STEP = {"every_n_train_steps": 1, "save_top_k": -1, "save_last": True, "filename": "{step}"}
BASE = {
    "n": 40, "batch_size": 4, "max_epochs": 2, "dropout": 0.2, "augment": True, "shuffle": True, "ckpt": EVERY_STEP,
    "safetensors": True, "async": True, "overlap_copy": True, "edit_weights": True, "slow_copy": 0.05,
}  # fmt: skip

# name: (config overrides, pause before micro-batch k, micro-batches trained before the checkpoint)
CASES = {
    "accumulate": ({"accumulate": 2}, 9, 8),
    "bf16_scheduler": ({"precision": "bf16-mixed", "scheduler": True, "accumulate": 3}, 10, 10),
    "manual_two_optimizers": ({"manual": True}, 7, 7),
}


@pytest.mark.parametrize("case", list(CASES))
def test_overlapped_copy_resumes_bit_for_bit(tmp_path: Path, case: str) -> None:
    overrides, pause, resumed_after = CASES[case]
    a, c = h.three_runs({**BASE, **overrides}, tmp_path, pause)
    h.assert_exact_resume(a["out"], c["out"], resumed_after, compare_saves=True)
    for run in (a, c):
        stats = json.loads((Path(run["out"]) / "report-rank0.json").read_text())["overlap_copy"]
        assert stats["guarded"] > 0, f"the guard copied nothing: the edits never met a copy in flight ({stats})"
        assert stats["recopied"] == 0, stats
