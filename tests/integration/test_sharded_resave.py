"""SIGKILL while a committed sharded directory is being re-saved (``last``): the final name always loads.

Each case is its own process (tests/helpers/jobs/sharded_job.py ``--resave PHASE``): it commits ``ckpt/last`` at
step 1, re-saves it at step 2 and pauses at one point of the save, where it is SIGKILLed. The four
processes run at once to keep the test short.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from lightning_resume import load_full, newest_committed, verify_sharded
from lightning_resume.sharded.api import clean_uncommitted, load_meta
from tests.helpers import sharded_runs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# phase -> the step that must be under the final name once the killed save is cleaned up
PHASES = {"commit": 1, "swap": 1, "delete": 2, "fallback-gap": 2}


def start(out: Path, phase: str) -> subprocess.Popen:
    out.mkdir()
    return sharded_runs.start_raw(out, "--resave", phase)


def assert_loads_as(last: Path, step: int) -> None:
    assert verify_sharded(str(last)).step == step
    assert torch.equal(load_full(str(last))["model"]["w"], torch.full((64, 8), float(step)))
    assert load_meta(str(last)) == {"step": step}


def test_sigkill_anywhere_in_a_resave_leaves_a_committed_directory_under_the_final_name(tmp_path):
    procs = {phase: start(tmp_path / phase, phase) for phase in PHASES}
    deadline = time.monotonic() + 360  # for all four together (liveness only)
    for phase, proc in procs.items():
        sharded_runs.kill_when_paused(proc, tmp_path / phase, timeout=max(deadline - time.monotonic(), 0.0))
    for phase, step in PHASES.items():
        root = tmp_path / phase / "ckpt"
        last = root / "last"
        if phase == "fallback-gap":  # no atomic exchange: killed between "old aside" and "new in place"
            assert not last.exists() and newest_committed(str(root)) is None
            clean_uncommitted(str(root))  # puts the newest committed one back under the final name
        else:
            assert_loads_as(last, step)
            assert newest_committed(str(root)) == str(last)
            clean_uncommitted(str(root))
        assert_loads_as(last, step)
        assert os.listdir(root) == ["last"], phase  # every staging / replaced leftover is gone
