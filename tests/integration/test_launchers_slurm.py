"""SLURM requeue, simulated: SLURM variables set, a fake ``scontrol`` first on PATH, a real SIGUSR1.

Lightning's SLURM environment (``auto_requeue=True``, the default inside a job) saves from inside its
signal handler and requeues. With ``ExactResume`` the signal becomes a snapshot at the next step
boundary, durable, then ``scontrol requeue <job>`` once, then exit 0; the requeued job resumes exactly,
whether its script passes ``ckpt_path="last"`` or ``None`` (Lightning's ``hpc_ckpt_N`` resolution).
"""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import pytest

from tests.helpers import kill_resume as h

pytestmark = pytest.mark.slow

CFG = {"n": 40, "batch_size": 4, "max_epochs": 2, "dropout": 0.2, "augment": True, "shuffle": True, "slow": 0.15}


def _slurm(tmp_path: Path, job_id: str = "4242") -> tuple[dict[str, str], Path]:
    """Environment of a one-task SLURM job whose ``scontrol`` records its arguments in the returned file."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol-calls.txt"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit 0\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IXUSR)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": job_id,
        "SLURM_JOB_NAME": "train",
        "SLURM_NTASKS": "1",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_NODEID": "0",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODELIST": "localhost",
    }
    return env, calls


def test_sigusr1_snapshots_requeues_once_and_the_requeued_job_resumes_exactly(tmp_path: Path) -> None:
    env, calls = _slurm(tmp_path)
    base = dict(CFG, ckpt={"save_top_k": 0})
    a = h.uninterrupted(base, tmp_path)
    b = dict(base, out=str(tmp_path / "B"), ckpt_dir=str(tmp_path / "B" / "ckpt"), env=env)
    assert h.signal_after(b, tmp_path, signal.SIGUSR1) == 0, h.output(b)
    assert calls.read_text().splitlines() == ["requeue 4242"], h.output(b)
    saved = h.snapshot_step(b["ckpt_dir"])
    assert len(h.steps(b["out"])) == saved  # stopped at the snapshot's step boundary
    [hpc] = tmp_path.glob("hpc_ckpt_*.ckpt")  # Lightning's in-handler save did not happen: only ours
    snapshot = next(Path(b["ckpt_dir"]).glob("last-snapshot-step=*.ckpt"))
    assert hpc.name == "hpc_ckpt_1.ckpt" and os.path.samefile(hpc, snapshot)  # linked: instant at any size
    # the requeued job, as SLURM users' scripts write it: ckpt_path=None (Lightning's hpc resolution) ...
    c = dict(base, out=str(tmp_path / "C"), ckpt_dir=b["ckpt_dir"], resume=None, env=env)
    h.run(c, tmp_path)
    h.assert_exact_resume(a["out"], c["out"], resumed_after=saved)
    # ... or ckpt_path="last"
    d = dict(base, out=str(tmp_path / "D"), ckpt_dir=b["ckpt_dir"], resume="last", env=env)
    h.run(d, tmp_path)
    h.assert_exact_resume(a["out"], d["out"], resumed_after=saved)


def test_without_auto_requeue_the_signal_snapshots_and_stops_without_requeue(tmp_path: Path) -> None:
    env, calls = _slurm(tmp_path)
    b = dict(CFG, out=str(tmp_path / "B"), ckpt_dir=str(tmp_path / "B" / "ckpt"), env=env,
             ckpt={"save_top_k": 0}, slurm_auto_requeue=False)  # fmt: skip
    assert h.signal_after(b, tmp_path, signal.SIGUSR1) == 0, h.output(b)
    assert not calls.exists()
    assert h.snapshot_step(b["ckpt_dir"]) == len(h.steps(b["out"]))
    assert not list(tmp_path.glob("hpc_ckpt_*.ckpt"))
