"""Running the two-process sharded jobs from the integration tests: ``jobs/sharded_job.py`` (raw FSDP2 over
gloo) and ``jobs/sharded_lightning_job.py`` (Lightning's ``ModelParallelStrategy``), each in its own
process group, and reading the ``final.pt`` they leave. What the jobs do with their flags is theirs.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Optional

import torch

from tests.helpers import processes
from tests.helpers.paths import job_script

ENV = {"PYTHONWARNINGS": "ignore"}
"""On top of ``processes.child_env``: FSDP2 and DCP warn on every rank at every save."""


def start_raw(out: Path, *flags: str) -> subprocess.Popen:
    """Start ``sharded_job.py OUT FLAGS`` (its output piped)."""
    return processes.start([job_script("sharded_job.py"), out, *flags], env=ENV)


def raw(out: Path, *flags: str, timeout: float = 120) -> dict:
    """Run ``sharded_job.py OUT FLAGS`` to a clean exit; its ``OUT/final.pt``."""
    processes.finish(start_raw(out, *flags), timeout)
    return torch.load(out / "final.pt", weights_only=True)


def start_fit(out: Path, ckpt: Optional[str] = None, *flags: str) -> subprocess.Popen:
    """Start ``sharded_lightning_job.py OUT [CKPT] FLAGS`` (its output piped)."""
    args = [job_script("sharded_lightning_job.py"), out, *([ckpt] if ckpt else []), *flags]
    return processes.start(args, env=ENV)


def fit(out: Path, ckpt: Optional[str] = None, *flags: str, timeout: float = 150) -> dict:
    """Run ``sharded_lightning_job.py OUT [CKPT] FLAGS`` to a clean exit; its ``OUT/final.pt``."""
    processes.finish(start_fit(out, ckpt, *flags), timeout)
    return torch.load(out / "final.pt", weights_only=True)


def fit_until_paused(out: Path, *flags: str, timeout: float = 120) -> None:
    """Run ``sharded_lightning_job.py OUT FLAGS`` (``--pause-before K`` among them) and SIGKILL its process
    group once it is paused."""
    kill_when_paused(start_fit(out, None, *flags), out, timeout)


def kill_when_paused(proc: subprocess.Popen, out: Path, timeout: float = 120) -> None:
    """SIGKILL the job's process group once it announced its pause point in ``OUT/paused``."""
    processes.kill_when(proc, (out / "paused").exists, timeout)
