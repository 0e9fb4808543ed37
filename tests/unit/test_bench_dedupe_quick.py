"""``benchmarks/bench_dedupe.py --quick`` runs end to end against the package as it is now: every scenario
(LoRA on a tiny Llama with ``RetentionCheckpoint``, a full fine-tune, an embedding with sparse rows) with both
plugins, ``dedupe=False`` and ``dedupe=True``, and every table. Its times mean nothing; its bytes are exact, so
it checks the one figure that cannot be noise: with the base frozen, a ``dedupe=True`` save after the first
writes a small part of what today's does, and the kept set of the retention run uses less disk."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.multiprocess
def test_bench_dedupe_quick_measures_both_plugins() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_dedupe.py"), "--quick"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    rows = {(line.split("|")[1].strip(), line.split("|")[2].strip()): line for line in lines}
    for scenario in ("lora", "full", "embedding"):
        for plugin in ("dedupe=False (today)", "dedupe=True"):
            assert (scenario, plugin) in rows, done.stdout
    ratios = {k[0]: float(v.split("|")[2]) for k, v in rows.items() if re.fullmatch(r"[\d.]+", k[1])}
    assert ratios["lora"] < 0.5, done.stdout  # the frozen base is referenced, not written again
    assert 0.95 < ratios["full"] < 1.05, done.stdout  # every tensor changed: everything is written
    disk = {k[0]: v for k, v in rows.items() if k[0].startswith("dedupe=")}
    used = {k: float(v.split("|")[4].split()[0]) for k, v in disk.items()}
    assert used["dedupe=True"] < used["dedupe=False (today)"], done.stdout
    assert "| 64 KiB |" in done.stdout, done.stdout
