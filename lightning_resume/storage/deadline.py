"""The instant by which a remote read must end, every retry of every layer included (``RemoteOptions.read_deadline``).

A deadline is a plain value over an injected clock: created once per load (or per read outside a load), it tells
each layer how much time is left. ``storage.files`` ends a transfer still running then (an async filesystem's
coroutine is cancelled with everything it retries: ours, s3fs's and botocore's) and raises
``RemoteReadTimeoutError``. This module reads no files and makes no request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from lightning_resume.errors import RemoteReadTimeoutError

DEFAULT_READ_DEADLINE_S = 600.0
"""Longest one load from a URL (or one read outside a load) may take, every retry included: 10 minutes."""


@dataclass(frozen=True)
class Deadline:
    """``seconds`` after the clock read ``start``; ``clock`` is ``time.monotonic`` unless a test injects one."""

    seconds: float
    start: float
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)

    @classmethod
    def after(cls, seconds: float = DEFAULT_READ_DEADLINE_S, clock: Callable[[], float] = time.monotonic) -> Deadline:
        return cls(float(seconds), clock(), clock)

    def remaining(self) -> float:
        """Seconds left (zero or less once it passed)."""
        return self.start + self.seconds - self.clock()

    def error(self, url: str, what: str) -> RemoteReadTimeoutError:
        return RemoteReadTimeoutError(url, what, self.seconds)


def or_default(deadline: Deadline | None) -> Deadline:
    """``deadline``, or a fresh default one for a read made outside a load."""
    return Deadline.after() if deadline is None else deadline
