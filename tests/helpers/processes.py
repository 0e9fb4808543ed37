"""Child processes for the tests that need fresh interpreters: start ``python ARGS`` with the repo root
importable, each in its own session so a SIGKILL reaches every process it started (DDP ranks, data workers),
wait for it, and kill it from outside at a moment the test polls for, so the child does not choose it.

It knows nothing of what the children train or write: the jobs live in ``tests/helpers/jobs`` and the
trainee harness in ``tests/helpers/kill_resume.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from lightning_resume.prove import runner
from tests.helpers import preloaded
from tests.helpers.paths import REPO_ROOT

TAIL = 3000
"""Characters of a child's output shown when it fails."""


def child_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """This process's environment, one intra-op thread, ``extra`` on top, and the repo root first on
    ``PYTHONPATH`` (so the package under test and ``tests.helpers`` are what the child imports)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra or {})}
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def start(
    args: Sequence[str],
    env: Optional[dict[str, str]] = None,
    cwd: Union[str, Path] = REPO_ROOT,
    log: Optional[Path] = None,
) -> subprocess.Popen:
    """``python ARGS`` in a new session (``lightning_resume.prove.runner.start_process``, the one ``prove``
    uses); stdout and stderr together into ``log``, or a text pipe without one."""
    return runner.start_process([sys.executable, *map(str, args)], cwd, child_env(env), log)


def start_preloaded(
    script: Union[str, Path],
    args: Sequence[object],
    env: Optional[dict[str, str]] = None,
    cwd: Union[str, Path] = REPO_ROOT,
    log: Optional[Path] = None,
) -> preloaded.PreloadedProcess:
    """``python SCRIPT ARGS`` as ``start`` runs it (a new session, ``child_env``, output into ``log``), forked
    from a server that imported torch and Lightning once (``tests/helpers/preloaded.py``): about 4 s less
    per launch. For job scripts that start from nothing but their arguments; a test of what a new interpreter
    imports uses ``start``."""
    if log is None:
        raise ValueError("a preloaded child writes its output into a log file: pass log=")
    return preloaded.start(script, [str(a) for a in args], cwd, child_env(env), log)


def output(proc: subprocess.Popen) -> str:
    """What a finished (or killed) child started without ``log`` printed."""
    return proc.stdout.read() if proc.stdout is not None else ""


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole session and reap it (``prove.runner.kill_group``)."""
    runner.kill_group(proc)


def finish(proc: subprocess.Popen, timeout: float = 120) -> str:
    """Wait for the child to exit 0 and return its output; kill it when ``timeout`` runs out."""
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        raise
    assert proc.returncode == 0, f"{proc.args} failed with {proc.returncode}:\n{(text or '')[-TAIL:]}"
    return text or ""


def run(args: Sequence[str], timeout: float = 120, env: Optional[dict[str, str]] = None) -> str:
    """``python ARGS`` to a clean exit; its output (stdout and stderr together)."""
    return finish(start(args, env), timeout)


def kill_when(
    proc: subprocess.Popen,
    ready: Callable[[], bool],
    timeout: float = 120,
    log: Callable[[], str] = lambda: "",
    delay: float = 0.0,
) -> None:
    """SIGKILL the child ``delay`` s after ``ready()`` is true (polled every 10 ms); fail, with its output
    (``log()`` for a child started with a log file), if it exits first or ``timeout`` runs out."""
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            if proc.poll() is not None:
                raise AssertionError(f"child ended before the kill point ({proc.returncode}):\n{_tail(proc, log)}")
            if time.monotonic() > deadline:
                kill(proc)
                raise AssertionError(f"kill point not reached in {timeout} s:\n{_tail(proc, log)}")
            time.sleep(0.01)
        time.sleep(delay)
    finally:
        kill(proc)


def _tail(proc: subprocess.Popen, log: Callable[[], str]) -> str:
    return (log() or output(proc))[-TAIL:]


def log_tail(directory: Path, prefix: str, chars: int = 3000) -> str:
    """The last ``chars`` of each ``<prefix>*.log`` under ``directory`` (launcher logs, e.g. one per torchrun node)."""
    return "\n".join(p.read_text()[-chars:] for p in sorted(Path(directory).glob(f"{prefix}*.log")))
