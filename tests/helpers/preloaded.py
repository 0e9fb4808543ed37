"""Start job scripts in fresh processes without paying for ``import torch, lightning`` each time.

Most of a kill-and-resume test's time went to interpreter starts: a trainee run of 30 steps takes 5 s, of
which 3.7 s import torch, Lightning and torchdata and 0.5 s train. ``start`` forks each run from a server
process that imported those three once (multiprocessing's ``forkserver``, one per test session). The child
is a new process as the test needs it: its own pid and session (so a SIGKILL of its group reaches the DDP
ranks and data workers it starts), working directory, environment, ``sys.argv``, ``sys.path[0]`` (the
script's directory), stdout and stderr into its log; it imports ``lightning_resume`` and everything else
itself, trains from nothing it inherited, and exits through ``threading._shutdown`` and the ``atexit``
handlers as an interpreter does. Python's ``random`` reseeds itself at fork; numpy's global generator is
reseeded here, as a fresh interpreter's would be, and multiprocessing's start method is the platform's
default again (a Process of the server inherits ``forkserver``; data workers must be forked from the
child, as from an interpreter). Lightning's DDP launcher starts the other ranks as new
interpreters of the script (``__main__`` is the script, ``__spec__`` ``None``, as ``runpy.run_path`` sets).

What it does not do: re-read at import time an environment variable the three preloaded packages read at
their import (the server runs with ``OMP_NUM_THREADS=1`` like every child). Only stdlib imports here: this
module is what the server's children import first.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import runpy
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

PRELOAD = ("torch", "lightning.pytorch", "torchdata.stateful_dataloader")
"""What the server imports once; every child finds them in ``sys.modules``."""

_context: Optional[multiprocessing.context.ForkServerContext] = None


def _server() -> multiprocessing.context.ForkServerContext:
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(list(PRELOAD))
        old = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # the server imports torch with the children's thread count
        try:
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            if old is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = old
        _context = context
    return _context


class PreloadedProcess:
    """The part of ``subprocess.Popen`` the tests use (``pid``, ``args``, ``poll``, ``wait``, ``returncode``,
    ``stdout`` always ``None``: the output is in the log) for a child the server forked."""

    stdout = None

    def __init__(self, process: multiprocessing.process.BaseProcess, args: Sequence[str]) -> None:
        self._process = process
        self.args = list(args)
        self.pid = process.pid

    @property
    def returncode(self) -> Optional[int]:
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code


def start(
    script: Union[str, Path], args: Sequence[str], cwd: Union[str, Path], env: Mapping[str, str], log: Path
) -> PreloadedProcess:
    """``python SCRIPT ARGS`` in ``cwd`` with exactly ``env``, stdout and stderr into ``log`` (see the module)."""
    argv = [str(script), *map(str, args)]
    process = _server().Process(target=_run, args=(argv, str(cwd), dict(env), str(log)), daemon=False)
    process.start()
    _wait_for_session(process)
    return PreloadedProcess(process, [sys.executable, *argv])


def _wait_for_session(process: multiprocessing.process.BaseProcess, timeout: float = 120.0) -> None:
    """Until the child leads a session of its own (``os.setsid``, its first act): a kill of its group
    sent before that would miss it, where ``Popen(start_new_session=True)`` has no such moment."""
    deadline = time.monotonic() + timeout
    while process.exitcode is None and time.monotonic() < deadline:
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(process.pid) == process.pid:
                return
        time.sleep(0.001)


def _run(argv: list[str], cwd: str, env: dict[str, str], log: str) -> None:
    """In the forked child: become the script's process, run it as ``__main__``, exit as an interpreter does."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = [os.path.dirname(os.path.abspath(argv[0])), *path]
    sys.path[:] = first + [p for p in sys.path if p not in first]
    sys.argv[:] = argv
    multiprocessing.set_start_method(None, force=True)  # the platform's default again (not the server's): data
    # workers are forked from this process, as from any interpreter, not started by the server
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # a fresh interpreter seeds it from the OS
    code: object = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # what an interpreter does at exit, in its order
    atexit._run_exitfuncs()
    sys.exit(code)  # multiprocessing's exit: an int is the exit status, a message is printed with status 1
