"""Find and kill every process a launch started, wherever it went: its own session, a new process group, an
orphan whose parent died (torchrun's workers are started with ``start_new_session=True``, out of reach of a
kill of the launch's group).

Two marks make a launch's processes findable. While a launch runs, this process is a child subreaper
(``prctl(PR_SET_CHILD_SUBREAPER)``, Linux), so an orphaned descendant is re-parented here instead of to init
and stays in our process tree; and each launch gets a token in its environment (``LAUNCH_ENV``), which its
descendants inherit, so that among our own descendants those of one launch are told from others. A
launch's processes are the launch root's subtree plus, among our descendants, every process carrying the
token, with their subtrees. The process table is read from ``/proc``. This module knows processes, not
training: no Lightning, no traces.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

LAUNCH_ENV = "LIGHTNING_RESUME_PROVE_LAUNCH"
"""The environment variable whose value marks one launch's processes."""

_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37  # linux/prctl.h
_PROC = Path("/proc")


@dataclass(frozen=True)
class Leftover:
    """A process of a launch still there when it should not be: its ``pid`` and command line."""

    pid: int
    cmdline: str

    def __str__(self) -> str:
        return f"pid {self.pid}: {self.cmdline}"


def set_subreaper(on: bool) -> bool:
    """Make this process the child subreaper of its descendants, or stop; returns whether it was one before
    (to put back once the launch is over: meanwhile a descendant orphaned by anything else than the launch
    would wait here, unreaped). ``False`` without a change where the system has none (not Linux, where no
    ``/proc`` is read either and a kill reaches the launch's process group only)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    before = ctypes.c_int(0)
    if libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(before), 0, 0, 0) != 0:
        return False
    libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)
    return bool(before.value)


def new_token() -> str:
    """A fresh value for ``LAUNCH_ENV``: one per launch."""
    return uuid.uuid4().hex


def launch_processes(root: int, token: str) -> set[int]:
    """Every process of the launch ``root`` (with ``token`` in its environment), zombies included: among
    this process's descendants only, so that a pid reused by another process is never taken."""
    return _launch_processes(root, token, _process_table())


def kill_launch(root: int, token: str, patience_s: float = 30.0) -> list[Leftover]:
    """SIGKILL every process of the launch (``launch_processes``) until none is left, and reap those that
    became our children (the root excepted: its ``Popen`` reaps it). Those still running after
    ``patience_s`` (a process stuck in the kernel) are returned."""
    deadline = time.monotonic() + patience_s
    seen: set[int] = set()  # a killed orphan's environment is gone: remember it to reap it
    while True:
        table = _process_table()
        seen = (seen & _descendants(table)) | _launch_processes(root, token, table)
        alive = {pid for pid in seen if table[pid][1] != "Z"}
        for pid in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        _reap(seen - {root})
        if not (seen - {root}) and root not in alive:
            return []
        if time.monotonic() > deadline:
            return [Leftover(pid, _cmdline(pid)) for pid in sorted(alive - {root})]
        time.sleep(0.01)


def leftovers(root: int, token: str) -> list[Leftover]:
    """The launch's processes still running (zombies aside), named, once its root has ended."""
    table = _process_table()
    found = _launch_processes(root, token, table) - {root}
    return [Leftover(pid, _cmdline(pid)) for pid in sorted(found) if table[pid][1] != "Z"]


def _reap(pids: set[int]) -> None:
    """Collect the exit status of each of ``pids`` that is our child and has ended (no other is touched)."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def _launch_processes(root: int, token: str, table: dict[int, tuple[int, str]]) -> set[int]:
    ours = _descendants(table)
    seeds = ({root} & ours) | {pid for pid in ours if _has_token(pid, token)}
    children = _children(table)
    found: set[int] = set()
    for seed in seeds:
        found |= _subtree(seed, children)
    return found


def _descendants(table: dict[int, tuple[int, str]]) -> set[int]:
    """This process's descendants in ``table``, not itself."""
    return _subtree(os.getpid(), _children(table)) - {os.getpid()}


def _children(table: dict[int, tuple[int, str]]) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    return children


def _process_table() -> dict[int, tuple[int, str]]:
    """``pid -> (ppid, state)`` of every process visible in ``/proc`` (none without one: not Linux, where
    only the kill of the launch's group is left)."""
    table: dict[int, tuple[int, str]] = {}
    if not _PROC.is_dir():
        return table
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            parsed = _stat(entry / "stat")
            if parsed is not None:
                table[int(entry.name)] = parsed
    return table


def _stat(path: Path) -> Optional[tuple[int, str]]:
    try:
        text = path.read_bytes().decode(errors="replace")
    except OSError:
        return None  # ended meanwhile
    fields = text[text.rfind(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return int(fields[1]), fields[0]


def _subtree(pid: int, children: dict[int, list[int]]) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(children.get(p, ()))
    return out


def _has_token(pid: int, token: str) -> bool:
    try:
        environ = (_PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return False  # ended, or not ours to read
    return f"{LAUNCH_ENV}={token}".encode() in environ.split(b"\0")


def _cmdline(pid: int) -> str:
    try:
        raw = (_PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:300] or "?"
