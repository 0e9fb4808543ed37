"""``lightning-resume prove`` of a script launched by ``torchrun`` with 2 workers: torchrun starts each
worker in a session of its own, so a kill of the launch's process group alone left them training (and
``prove`` said DIFFERS, "no relaunch happened"). ``prove`` kills every process its launch started, and the
verdict is EXACT. Rendezvous on 127.0.0.1 only."""

from __future__ import annotations

import sys
from pathlib import Path

from lightning_resume.testing import assert_resumes_exactly
from tests.helpers.paths import REPO_ROOT

TARGET = REPO_ROOT / "tests" / "helpers" / "jobs" / "prove_target.py"
TORCHRUN = [
    sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0",
    "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
]  # fmt: skip


def test_a_torchrun_script_with_two_workers_proves_exact(tmp_path: Path) -> None:
    verdict = assert_resumes_exactly(
        [*TORCHRUN, str(TARGET), "--devices", "2", "--max_steps", "16"], kills=1, seed=0, workdir=tmp_path,
        timeout=240,
    )  # fmt: skip
    assert verdict.exact and sorted(verdict.launches) == [0, 1] and verdict.launches[0] == 2, verdict
