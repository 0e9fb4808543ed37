"""A function run on a thread of its own, whose result or error the caller collects.

Hashing and copying release the GIL, so a checksum computed on a ``Background`` thread overlaps the
write (on save) or the read (on load) of the same bytes. Knows threads only.
"""

from __future__ import annotations

import threading
from typing import Any, Optional


class Background:
    """Run ``fn(*args)`` on a thread (hashing releases the GIL, so it overlaps with copying tensors)."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self._error: Optional[BaseException] = None
        self._value: Any = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self._thread.start()

    def _run(self, fn: Any, args: tuple[Any, ...]) -> None:
        try:
            self._value = fn(*args)
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread by result()
            self._error = err

    def join(self) -> None:
        self._thread.join()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
