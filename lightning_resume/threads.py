"""The io's background threads: one ordered job queue for async saves, and one-off functions on a thread.

:class:`OrderedWriter` runs jobs strictly in submission order on one daemon thread: the atomic,
checksummed commit of an async save and the deletions asked for after it, so a prune never overtakes
the save it depends on, and a deletion queued behind a failed write is skipped (nothing good is deleted
on a full disk). Its thread runs at a lower CPU and I/O priority than training
(:func:`lower_thread_priority`), so its hashing and writing take the cores training leaves idle.
:class:`Background` runs one function on a thread of its own and hands its result or error to the
caller: hashing and copying release the GIL, so a checksum computed there overlaps the write (on save)
or the read (on load) of the same bytes. Knows threads only: no tensors, no files, no Lightning.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, List, Optional

log = logging.getLogger(__name__)

WRITER_NICE = 10
"""How far below the training thread the writer's CPU priority is (a ``nice`` increment; 19 is the lowest)."""

_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "arm64": 30}  # syscall numbers; the libc has no wrapper
_IOPRIO_WHO_PROCESS = 1  # with a thread id: that thread only
_IOPRIO_BEST_EFFORT_LOWEST = (2 << 13) | 7  # class best-effort, level 7 (not "idle": that could starve the save)


def lower_thread_priority(nice: int = WRITER_NICE) -> bool:
    """Lower the calling thread's CPU priority by ``nice`` and its I/O priority to the lowest best-effort
    level, so training threads get the cores and the disk first; threads it starts later inherit both.

    Linux only (elsewhere ``setpriority`` would apply to the whole process): a no-op returning ``False``.
    Fails soft: where the OS refuses (seccomp, containers), the thread keeps its priority, one debug
    line says so, and ``False`` is returned. ``True`` when both were lowered.
    """
    if not sys.platform.startswith("linux") or nice <= 0:
        return False
    tid = threading.get_native_id()
    lowered = True
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as err:
        log.debug("could not lower the CPU priority of the checkpoint writer thread: %s", err)
        lowered = False
    try:
        _ioprio_set(tid, _IOPRIO_BEST_EFFORT_LOWEST)
    except OSError as err:
        log.debug("could not lower the I/O priority of the checkpoint writer thread: %s", err)
        lowered = False
    return lowered


def _ioprio_set(tid: int, value: int) -> None:
    number = _IOPRIO_SET.get(platform.machine())
    if number is None:
        raise OSError(f"ioprio_set: no syscall number known for {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, _IOPRIO_WHO_PROCESS, tid, value) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@dataclass(eq=False)
class Job:
    """One unit of background work. ``after`` is the write a deletion depends on."""

    kind: str  # "write" or "remove"
    path: str
    run: Callable[[], None]
    after: Optional[Job] = None
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[BaseException] = None
    skipped: bool = False
    seconds: float = 0.0


class OrderedWriter:
    """A single daemon thread that runs submitted jobs one at a time, in submission order.

    The thread runs ``nice`` steps below its creator's CPU priority and at the lowest best-effort I/O
    priority (:func:`lower_thread_priority`; ``nice=0`` keeps the creator's); ``lowered`` tells whether
    the OS allowed it (``None`` before the thread first ran).
    """

    def __init__(self, name: str = "lightning-resume-writer", nice: int = WRITER_NICE) -> None:
        self._name = name
        self.nice = nice
        self.lowered: Optional[bool] = None
        self._cv = threading.Condition()
        self._queue: Deque[Job] = deque()
        self._outstanding: List[Job] = []
        self._failed: List[Job] = []
        self._thread: Optional[threading.Thread] = None

    def submit(self, job: Job) -> Job:
        with self._cv:
            self._outstanding.append(job)
            self._queue.append(job)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return job

    def outstanding(self, path: Optional[str] = None, kind: Optional[str] = None) -> List[Job]:
        """Jobs queued or running (for ``path`` and of ``kind`` when given), oldest first."""
        with self._cv:
            return [
                j for j in self._outstanding if (path is None or j.path == path) and (kind is None or j.kind == kind)
            ]

    def wait(self, jobs: List[Job], timeout: Optional[float] = None) -> bool:
        """Block until every job in ``jobs`` is done; ``False`` if ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in jobs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not job.done.wait(left):
                return False
        return True

    def take_failed(self) -> List[Job]:
        """Jobs that raised since the last call, oldest first (each is handed out once)."""
        with self._cv:
            failed, self._failed = self._failed, []
        return failed

    def discard(self, job: Job) -> None:
        """Forget ``job``'s failure (its cause was already raised to the caller another way)."""
        with self._cv:
            self._failed = [j for j in self._failed if j is not job]

    def _loop(self) -> None:
        self.lowered = lower_thread_priority(self.nice)
        while True:
            with self._cv:
                while not self._queue:
                    if not self._cv.wait(timeout=30.0) and not self._queue:
                        self._thread = None  # idle: exit; the next submit starts a fresh thread
                        return
                job = self._queue.popleft()
            self._run(job)
            with self._cv:
                self._outstanding.remove(job)
                if job.error is not None:
                    self._failed.append(job)
                job.done.set()
                self._cv.notify_all()

    def _run(self, job: Job) -> None:
        if job.after is not None and job.after.error is not None:
            job.skipped = True  # the write this deletion made redundant did not happen: keep the old file
            log.warning("skipped deleting %s: the checkpoint written before it (%s) failed", job.path, job.after.path)
            return
        started = time.monotonic()
        try:
            job.run()
        except BaseException as err:  # noqa: BLE001 - handed out by take_failed; never lost
            job.error = err
        job.seconds = time.monotonic() - started


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
