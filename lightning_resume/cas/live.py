"""The packs this process's saves have written or will reference while their checkpoint file is not committed yet.

A pack is unreferenced from the moment a save commits it until the checkpoint file naming it is committed (and a
pack a save is about to reference may look unreferenced if the last checkpoint naming it is being removed). Garbage
collection (``cas.gc``) keeps every pack in :func:`pending`. Process-wide and thread-safe: the save that registers a
pack may run on a writer thread while a collection runs on another.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import Iterable, Iterator, Set

_lock = threading.Lock()
_pending: Counter = Counter()  # pack path -> number of saves in flight holding it


def pending() -> Set[str]:
    """Pack paths that saves in flight in this process hold (written or to be referenced, not yet committed to)."""
    with _lock:
        return set(_pending)


def hold(paths: Iterable[str]) -> None:
    """Mark ``paths`` pending until the same save calls :func:`release` on them."""
    with _lock:
        _pending.update(set(paths))


def release(paths: Iterable[str]) -> None:
    with _lock:
        for p in set(paths):
            _pending[p] -= 1
            if _pending[p] <= 0:
                del _pending[p]


@contextlib.contextmanager
def holding() -> Iterator[Holder]:
    """A save's holds, all released when it ends (committed or failed)."""
    holder = Holder()
    try:
        yield holder
    finally:
        release(holder.paths)


class Holder:
    def __init__(self) -> None:
        self.paths: Set[str] = set()

    def add(self, paths: Iterable[str]) -> None:
        new = set(paths) - self.paths
        hold(new)
        self.paths |= new
