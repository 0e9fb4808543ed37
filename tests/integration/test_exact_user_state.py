"""Exact resume with state users keep outside Lightning's lists, written the way public Lightning code
writes it (``tests/helpers/jobs/user_state_job.py``): a hand-stepped LR scheduler attribute, torchmetrics
epoch metrics with a monitored checkpoint, an environment object with NumPy and Python generators, an
iterable over a replay buffer the module fills, and a generator registered with ``ExactResume(state=...)``.

Each case: A uninterrupted, B SIGKILLed mid-epoch, C resuming B's ``last`` in a fresh process; C's steps
(sample ids, loss bits, learning rate, every logged metric's bits) continue A's, and the final state is A's.
Each case's control (the same kill and resume with the capture switched off) differs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import kill_resume as h

EXTENDED = frozenset({"test_user_state_resumes_bit_for_bit[env]", "test_user_state_resumes_bit_for_bit[registered]"})
"""Outside `make test`: the generator cases (the replay case holds a numpy Generator on a plain object too)."""

EPOCH = 10
"""Training batches per epoch (40 samples, batch size 4)."""

BASE = {
    "job": "user_state_job.py",
    "n": 4 * EPOCH,
    "batch_size": 4,
    "max_epochs": 3,
    "ckpt": {"every_n_train_steps": 3, "save_top_k": -1, "save_last": True, "filename": "{epoch}-{step}"},
}
CASES: dict[str, dict[str, Any]] = {
    "scheduler": {},
    "metrics": {
        "val_check_interval": 1.0,
        "monitor_ckpt": {"monitor": "train/acc", "mode": "max", "save_top_k": 2, "filename": "{epoch}-{step}"},
    },
    "env": {},
    "replay": {},
    "registered": {},
}
PAUSE = EPOCH + 5
"""Killed in the second epoch, two batches after the newest checkpoint (step 15 is saved at 15)."""


@pytest.mark.parametrize("case", list(CASES))
def test_user_state_resumes_bit_for_bit(tmp_path: Path, case: str) -> None:
    cfg = {**BASE, **CASES[case], "user_state": case}
    a, c = h.three_runs(cfg, tmp_path, pause=PAUSE)
    h.assert_exact_resume(a["out"], c["out"], resumed_after=None)
    restored = json.loads((Path(c["out"]) / "report-rank0.json").read_text())["user_state"]
    assert restored, f"nothing restored: {restored}"
    if case == "metrics":  # the monitored checkpoint kept the same best files
        assert _names(Path(a["ckpt_dir"] + "-monitor")) == _names(Path(c["ckpt_dir"] + "-monitor"))


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.ckpt"))
