"""PROVISIONAL (casgc): the packs saves of this process will reference; ``cas``'s version wins at merge."""

from __future__ import annotations

import threading
from typing import Set

_lock = threading.Lock()
_pending: Set[str] = set()


def pending() -> Set[str]:
    with _lock:
        return set(_pending)


def add(path: str) -> None:
    with _lock:
        _pending.add(str(path))


def discard(path: str) -> None:
    with _lock:
        _pending.discard(str(path))
