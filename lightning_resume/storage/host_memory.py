"""How much host memory this process can still take, as the kernel reports it (Linux; elsewhere unknown).

Two bounds, the smaller wins: the machine's ``MemAvailable`` (``/proc/meminfo``: free memory plus the page
cache and slabs the kernel can reclaim without swapping) and, under cgroup v2, the headroom of this
process's cgroup and of every ancestor that sets ``memory.max``: the limit minus ``memory.current``, with
the cgroup's inactive file cache (``memory.stat`` ``inactive_file``) added back, because the kernel
reclaims it before it kills anything (a container that just wrote a large checkpoint counts it in
``memory.current``). A file that is absent or unreadable is no bound; with none, the answer is unknown
(``None``) and callers must not refuse anything on it. This module reads those files and decides nothing:
whether a load fits is ``storage.remote_budget``'s. No psutil (not a dependency).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator, List, Optional


@dataclass(frozen=True)
class Available:
    """``nbytes`` this process can still allocate, and ``where`` that figure comes from (for messages)."""

    nbytes: int
    where: str


def available(
    meminfo: str = "/proc/meminfo", cgroup_root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup"
) -> Optional[Available]:
    """The tightest of the bounds this machine reports, or ``None`` if it reports none (the paths are
    parameters so tests can point them at fakes)."""
    bounds: List[Available] = []
    mem = _mem_available(meminfo)
    if mem is not None:
        bounds.append(Available(mem, f"MemAvailable in {meminfo}"))
    for directory in _cgroup_dirs(cgroup_root, self_cgroup):
        headroom = _cgroup_headroom(directory)
        if headroom is not None:
            bounds.append(Available(headroom, f"cgroup {directory}: memory.max - memory.current + inactive_file"))
    return min(bounds, key=lambda b: b.nbytes) if bounds else None


def _mem_available(meminfo: str) -> Optional[int]:
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    parts = line.split()
                    return int(parts[1]) * 1024 if len(parts) >= 3 and parts[2] == "kB" else int(parts[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_dirs(cgroup_root: str, self_cgroup: str) -> Iterator[str]:
    """This process's cgroup v2 directory and its ancestors up to the root (a limit anywhere above applies)."""
    relative = "/"
    try:
        with open(self_cgroup) as f:
            for line in f:
                if line.startswith("0::"):  # the v2 hierarchy; v1 lines name their controllers
                    relative = line[3:].strip() or "/"
    except OSError:
        pass
    directory = os.path.normpath(os.path.join(cgroup_root, relative.lstrip("/")))
    root = os.path.normpath(cgroup_root)
    while directory.startswith(root):
        yield directory
        if directory == root:
            return
        directory = os.path.dirname(directory)


def _cgroup_headroom(directory: str) -> Optional[int]:
    limit, current = (
        _read_int(os.path.join(directory, "memory.max")),
        _read_int(os.path.join(directory, "memory.current")),
    )
    if limit is None or current is None:
        return None  # "max" (no limit), or not a cgroup v2 memory controller
    return max(limit - current + _inactive_file(directory), 0)


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _inactive_file(directory: str) -> int:
    try:
        with open(os.path.join(directory, "memory.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "inactive_file":
                    return int(value)
    except (OSError, ValueError):
        return 0
    return 0
