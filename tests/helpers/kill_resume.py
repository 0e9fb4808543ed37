"""The kill/resume harness: run ``jobs/trainee.py`` in fresh processes, kill it from outside, and compare
runs bit for bit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from tests.helpers.compare import assert_bitwise
from tests.helpers.paths import JOBS_DIR, REPO_ROOT

ROOT = REPO_ROOT
TRAINEE = JOBS_DIR / "trainee.py"


def _env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    env = dict(os.environ, **(extra or {}))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _start(cfg: dict[str, Any], workdir: Path) -> subprocess.Popen:
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    log = open(out / "stdout.txt", "w")
    return subprocess.Popen(
        [sys.executable, str(TRAINEE), str(cfg_path)],
        cwd=workdir,
        env=_env(cfg.get("env")),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # one process group: DDP children die with it
    )


def _output(cfg: dict[str, Any]) -> str:
    return (Path(cfg["out"]) / "stdout.txt").read_text()[-6000:]


def run(cfg: dict[str, Any], workdir: Path, timeout: float = 240) -> None:
    """Run to completion; raise with the run's output if it fails."""
    proc = _start(cfg, workdir)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"run timed out:\n{_output(cfg)}")
    assert rc == 0, f"run failed with {rc}:\n{_output(cfg)}"


def kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def run_until_paused(cfg: dict[str, Any], workdir: Path, timeout: float = 240) -> None:
    """Start a run that blocks at ``cfg['pause_before']``, then SIGKILL it from outside."""
    marker = Path(cfg["out"]) / "paused"
    run_and_kill_when(cfg, workdir, marker.exists, timeout)


def run_and_kill_when(cfg: dict[str, Any], workdir: Path, ready, timeout: float = 240) -> None:
    """Start a run and SIGKILL it as soon as ``ready()`` is true (polled, so the moment is not chosen by the run)."""
    proc = _start(cfg, workdir)
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"run ended before the kill point ({proc.returncode}):\n{_output(cfg)}")
        if time.monotonic() > deadline:
            kill(proc)
            raise AssertionError(f"kill point not reached in time:\n{_output(cfg)}")
        time.sleep(0.01)
    kill(proc)


def steps(out: Path, rank: int = 0) -> list[dict[str, Any]]:
    path = Path(out) / f"steps-rank{rank}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def assert_same_final_state(a_out: Path, c_out: Path) -> None:
    a = torch.load(Path(a_out) / "final.pt", weights_only=True)
    c = torch.load(Path(c_out) / "final.pt", weights_only=True)
    assert_bitwise(a, c, "final")


def assert_exact_resume(a_out: Path, c_out: Path, resumed_after: Optional[int], ranks: int = 1) -> None:
    """C continues A bit for bit: C's micro-batches are A's after the first ``resumed_after`` ones
    (same samples, same loss bits, no batch repeated or skipped), and the final state is bitwise equal."""
    for rank in range(ranks):
        a, c = steps(a_out, rank), steps(c_out, rank)
        assert c, f"resumed run trained nothing (rank {rank})"
        n = len(a) - len(c)
        if resumed_after is not None:
            assert n == resumed_after, f"rank {rank}: resumed after {n} micro-batches, expected {resumed_after}"
        for i, (x, y) in enumerate(zip(a[n:], c)):
            assert x == y, f"rank {rank}: micro-batch {n + i} differs:\n uninterrupted {x}\n resumed       {y}"
    assert_same_final_state(a_out, c_out)
