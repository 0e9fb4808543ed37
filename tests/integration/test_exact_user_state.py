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

EXTENDED = frozenset(
    {
        "test_user_state_resumes_bit_for_bit[env]",
        "test_user_state_resumes_bit_for_bit[registered]",
        "test_without_the_capture_the_resume_differs[scheduler]",
        "test_without_the_capture_the_resume_differs[env]",
        "test_without_the_capture_the_resume_differs[replay]",
        "test_without_the_capture_the_resume_differs[registered]",
        "test_without_the_capture_the_resume_differs[metrics_epoch_end]",
    }
)
"""Outside `make test`: two generator cases (the replay case holds a numpy Generator on a plain object too)
and the controls but the metrics one."""

EPOCH = 10
"""Training batches per epoch (40 samples, batch size 4)."""

BASE = {
    "job": "user_state_job.py",
    "n": 4 * EPOCH,
    "batch_size": 4,
    "max_epochs": 3,
    "ckpt": {"every_n_train_steps": 3, "save_top_k": -1, "save_last": True, "filename": "{epoch}-{step}"},
}
MONITORED = {
    "val_check_interval": 1.0,
    "monitor_ckpt": {"monitor": "train/acc", "mode": "max", "save_top_k": 2, "filename": "{epoch}-{step}"},
}
PAUSE = EPOCH + 5
"""Killed in the second epoch, two batches after the newest checkpoint (step 15 is saved at 15)."""
CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    "scheduler": ("scheduler", {}, PAUSE),
    "metrics": ("metrics", MONITORED, PAUSE),
    # the newest checkpoint is the monitored one at epoch 0's validation end, before Lightning resets the metrics
    "metrics_epoch_end": ("metrics", MONITORED, EPOCH + 1),
    "env": ("env", {}, PAUSE),
    "replay": ("replay", {}, PAUSE),
    "registered": ("registered", {}, PAUSE),
}
"""case: (the job's ``user_state``, config, kill before this micro-batch)."""


@pytest.mark.parametrize("case", list(CASES))
def test_user_state_resumes_bit_for_bit(tmp_path: Path, case: str) -> None:
    user_state, extra, pause = CASES[case]
    cfg = {**BASE, **extra, "user_state": user_state}
    a, c = h.three_runs(cfg, tmp_path, pause=pause)
    h.assert_exact_resume(a["out"], c["out"], resumed_after=None)
    restored = json.loads((Path(c["out"]) / "report-rank0.json").read_text())["user_state"]
    assert restored, f"nothing restored: {restored}"
    # The monitored checkpoint keeps the same best files. Not checked when C resumes from the monitored callback's
    # own file: that file's ModelCheckpoint state does not count the file itself (Lightning's, not the metrics')
    if case == "metrics":
        assert _names(Path(a["ckpt_dir"] + "-monitor")) == _names(Path(c["ckpt_dir"] + "-monitor"))


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.ckpt"))


@pytest.mark.parametrize("case", list(CASES))
def test_without_the_capture_the_resume_differs(tmp_path: Path, case: str) -> None:
    """The control: the same kill and resume with ``ExactResume`` finding nothing (``registered``: nothing
    registered) continues A's run otherwise than A."""
    user_state, extra, pause = CASES[case]
    off = {"register": False} if case == "registered" else {"capture_user_state": False}
    cfg = {**BASE, **extra, "user_state": user_state, **off}
    a, c = h.three_runs(cfg, tmp_path, pause=pause)
    a_steps, c_steps = h.steps(a["out"]), h.steps(c["out"])
    assert a_steps[len(a_steps) - len(c_steps) :] != c_steps, f"{case}: the resumed run matched without the capture"
    verdict = h.prove_verdict(a["out"], c["out"])  # prove, on the same traces, names the part that differs first
    assert verdict is not None and not verdict.exact, verdict
    component, words = CONTROL_VERDICTS[case]
    assert verdict.component == component and words in verdict.cause + verdict.fix, verdict


CONTROL_VERDICTS = {
    "scheduler": ("optim", "ExactResume(state="),  # the LR the unsaved scheduler set, in the optimizer state
    "metrics": ("val", "torchmetrics"),
    "metrics_epoch_end": ("val", "torchmetrics"),  # the last epoch's logged metric, in the end record
    "env": ("loss", "ExactResume(state="),  # "not sure": nothing recorded names the environment's generators
    "replay": ("batch", "IterableDataset"),
    "registered": ("batch", "randomness"),
}
"""What ``prove`` says of each control: the component that differs first, and words of its cause or fix."""
