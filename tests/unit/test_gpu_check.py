"""``benchmarks/gpu_check.py`` (issue 44) cannot rot: its ``--dry-run`` runs every section's code on the CPU, the
kill-and-resume runs included (real child processes, SIGKILLed and resumed), and must end on a verdict line
with every section run and both resumes bit for bit. Its timings on the CPU mean nothing and are not checked.
Also, in process: a section that raises is reported ``FAIL`` and the next still runs; one over budget is
skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.multiprocess
def test_dry_run_ends_on_verdicts_with_every_section_run_and_exact(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(out), "--dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("VERDICT DRY-RUN"), done.stdout[-3000:]
    assert " bitwise=OK bitwise_ac=OK " in last and last.endswith("failed=none"), done.stdout[-3000:]
    assert "load=OK" in last and "step_while_writing=" in last and last.count("<dcp_best(") == 2, last
    sections = json.loads(out.read_text())["sections"]
    assert {k: v["status"] for k, v in sections.items()} == dict.fromkeys(
        ["resume", "resume_ac", "blocked_small", "step", "load", "blocked_large"], "OK"
    )
    for name in ("resume", "resume_ac"):  # the resume replayed steps after the checkpoint it restored
        assert sections[name]["resumed_from_step"] < sections[name]["killed_at_step"]
        assert sections[name]["resume_report"]["exact"] is True
    assert sections["resume_ac"]["equal_to_no_checkpointing"] is True
    assert sections["resume_ac"]["recomputed_blocks"] == ["blocks.0", "blocks.1"]


def test_a_failing_section_is_reported_the_next_still_runs_and_one_over_budget_is_skipped(
    monkeypatch, tmp_path: Path
) -> None:
    from benchmarks import gpu_check

    def run_section(ctx, name, deadline):
        if name == "step":
            raise RuntimeError("CUDA error: out of memory")
        return {"ran": name}

    monkeypatch.setattr(gpu_check, "run_section", run_section)
    args = gpu_check.parse(["--budget-s", "100", "--out", str(tmp_path / "r.json")])
    ctx = gpu_check.Context(torch.device("cpu"), False, tmp_path, args)
    gpu_check.run_all(ctx, ["step", "load", "blocked_large"], t_start=time.monotonic())
    got = json.loads((tmp_path / "r.json").read_text())["sections"]
    assert got["step"]["status"] == "FAIL" and "out of memory" in got["step"]["error"]
    assert got["load"] == {**got["load"], "status": "OK", "ran": "load"}  # estimated 60 s: fits in 100
    assert got["blocked_large"]["status"] == "SKIPPED"  # estimated 240 s: does not
    assert "failed=step" in gpu_check.verdicts(ctx)
