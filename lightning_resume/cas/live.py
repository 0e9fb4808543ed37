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
from typing import Callable, Iterable, Iterator, Set

_lock = threading.Lock()
_pending: Counter = Counter()  # pack path -> number of saves in flight holding it
_saving: Counter = Counter()  # blocks directory -> saves in flight there (writing a pack or choosing packs to reuse)


@contextlib.contextmanager
def saving(blocks: str) -> Iterator[None]:
    """A save in flight in the pack directory ``blocks``, from before it chooses the packs it reuses (and checks that
    they exist) until its checkpoint file is committed: no collection in this process removes a pack there meanwhile
    (:func:`remove_unless_saving`). Lightning's ``AsyncCheckpointIO`` runs a save on its own thread while the training
    thread removes an older checkpoint and collects, so the two may overlap."""
    key = blocks.rstrip("/")
    with _lock:
        _saving[key] += 1
    try:
        yield
    finally:
        with _lock:
            _saving[key] -= 1
            if _saving[key] <= 0:
                del _saving[key]


def remove_unless_saving(blocks: str, path: str, remove: Callable[[str], object]) -> bool:
    """Remove the pack ``path`` of the directory ``blocks`` with ``remove``, unless a save of this process is in
    flight there or holds it; whether it was removed. Decided and done under the lock a save takes to begin, so no
    save can choose the pack (or commit one under its name) between the check and the removal."""
    with _lock:
        if _saving.get(blocks.rstrip("/")) or path in _pending:
            return False
        remove(path)
        return True


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
