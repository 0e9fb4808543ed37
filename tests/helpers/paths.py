"""Where things are, independent of how deep the test module that asks sits in ``tests/``."""

from __future__ import annotations

import socket
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
JOBS_DIR = Path(__file__).resolve().parent / "jobs"


def job_script(name: str) -> str:
    """Absolute path of a job script in ``tests/helpers/jobs`` (run as ``python <path> ...``)."""
    path = JOBS_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"no job script {path}")
    return str(path)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous or a process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
