"""``benchmarks/bench_replica.py --quick`` runs end to end against the package as it is now: both parts (recovery
from a peer's replica, local disk and S3; a 2-node fit's step times) and the verdict line. Importing the script
(``test_benchmarks_import.py``) would not notice a renamed transport function or a changed ``MemoryStore``: those
are called only at run time, in its worker processes. The figures of a quick run mean nothing; only that every
row was measured."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.multiprocess
def test_bench_replica_quick_runs_both_parts() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_replica.py"), "--quick"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    lines = done.stdout.strip().splitlines()
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ")}
    expected = ["peer replica (recovery)", "local durable, cold", "local durable, warm", "bare transfer (limit)"]
    for row in [*expected, "calm"]:
        assert row in rows, done.stdout
    assert "bare in flight (limit)" in rows and "replica in flight" in rows, done.stdout
    assert "replicator on: True" in done.stdout and " 0 transfers timed" not in done.stdout, done.stdout
    assert lines[-1].startswith("VERDICT: "), done.stdout
    assert "faster than S3" in lines[-1] or "S3 rows skipped" in done.stdout, done.stdout
