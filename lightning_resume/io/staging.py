"""Async saving mechanism: snapshot into reusable host buffers, then write on one ordered worker.

Two phases, in order. On the training thread, :class:`HostBuffers` copies every tensor of the
checkpoint into one preallocated, block-aligned host byte pool laid out as the file's data section
(pinned, with non-blocking copies and one synchronisation per device, when a source is on CUDA), so
the worker can write it with direct I/O; the non-tensor tree is encoded to its JSON text. After that
nothing the next optimizer step mutates is referenced. :class:`StagedTensors` tells a reader which
tensors are copied yet, so a write may optionally follow the copy (``overlap``). On one background
thread, :class:`OrderedWriter` runs jobs strictly in submission order: the atomic, checksummed
commit of ``write.commit`` and the deletions asked for after it, so a prune never overtakes the
save it depends on, and a deletion queued behind a failed write is skipped (nothing good is deleted
on a full disk). :class:`AsyncSaver` ties them together: at most one save in flight (the next
waits for it, and that wait is measured), a worker's error is handed to the training thread at the
next save, at :meth:`AsyncSaver.wait` or at teardown, never lost. The worker runs at a lower CPU
and I/O priority than training (:func:`lower_thread_priority`), so its hashing and writing take the
cores training leaves idle. A save of the same tensors as the last one (the usual case) is copied on
a helper thread while the training thread encodes the tree (:meth:`HostBuffers.recopy_last`), and
taken only if every tensor is still the same memory seen the same way (:meth:`HostBuffers.adopt`).
This module knows tensors, threads and files, not Lightning.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from lightning_resume._compat.torch_ops import foreach_copy_
from lightning_resume.errors import AsyncWriteError, AsyncWriteWarning, StagingAborted
from lightning_resume.io import framing, integrity
from lightning_resume.io.framing import BLOCK

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------ host buffers


def _is_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


def _allocate(nbytes: int, pinned: bool) -> torch.Tensor:
    """The pool: page-locked when copies come from CUDA, so they can run as DMA without a bounce buffer."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def _synchronize(device: torch.device) -> None:
    torch.cuda.synchronize(device)


NOTIFY_BYTES = 8 << 20
"""Copied bytes between two wake-ups of the writer (fewer wake-ups, less contention for the training thread)."""


class StagedTensors(Dict[str, torch.Tensor]):
    """One snapshot's host copies, by name, in file order; filled in that order by :meth:`HostBuffers.fill`.

    The views exist before their bytes do: a reader (the background write) calls :meth:`wait` for each
    tensor before touching it, so the write of the first tensors overlaps the copy of the later ones.
    """

    def __init__(
        self,
        views: Dict[str, torch.Tensor],
        image: Optional[memoryview] = None,
        index: Optional[Dict[str, int]] = None,
    ) -> None:
        super().__init__(views)
        self.image = image
        """The data section as one buffer: the tensors' bytes back to back in file order, start and length
        a multiple of ``BLOCK`` (the tail past the last tensor is padding)."""
        self.digests: Optional[Dict[str, str]] = None
        """Each tensor's digest, when :meth:`HostBuffers.fill` was given an algorithm (computed right after
        the tensor's copy, while its bytes are in cache); ``None`` otherwise: the writer hashes."""
        self._index = index if index is not None else {name: i for i, name in enumerate(views)}
        self._copied = 0  # tensors [0, _copied) hold their bytes; only the filling thread writes it
        self._error: Optional[BaseException] = None
        self._cv = threading.Condition()

    def wait(self, name: str) -> None:
        """Block until ``self[name]`` holds its bytes; ``StagingAborted`` if the copy failed first."""
        i = self._index[name]
        if self._copied > i:
            return
        with self._cv:
            while self._copied <= i and self._error is None:
                self._cv.wait()
            if self._copied <= i:
                raise StagingAborted(f"the snapshot copy failed before tensor '{name}' was copied") from self._error

    def wait_all(self) -> None:
        for name in self:
            self.wait(name)

    def _copied_up_to(self, count: int, notify: bool) -> None:
        self._copied = count
        if notify:
            with self._cv:
                self._cv.notify_all()

    def _abort(self, error: BaseException) -> None:
        with self._cv:
            self._error = error
            self._cv.notify_all()


@dataclass(frozen=True)
class _Layout:
    """The pool carved for one state shape: reused by every save of a state with the same signature."""

    signature: Tuple
    views: Dict[str, torch.Tensor]
    index: Dict[str, int]
    image: memoryview


def _signature(tensors: Mapping[str, torch.Tensor]) -> Tuple:
    """What decides the layout and the pool: names, dtypes, shapes, CUDA or not (one tuple; cheap to compare)."""
    return tuple((name, t.dtype, t.shape, _is_cuda(t)) for name, t in tensors.items())


HASH_BATCH_BYTES = 256 << 10
"""With hashing during the copy: bytes copied before they are hashed (small enough to still be in cache)."""


class HostBuffers:
    """One host byte pool sized to the state and reused by every save, with its views and layout.

    The pool is allocated on the first save and again only if a later state needs more bytes, or
    needs pinning and the pool is not pinned; ``allocations`` counts that. The views of the pool, the
    file layout and the name index are rebuilt only when the state's signature (names, dtypes,
    shapes) changes, so a save of the same model costs one tuple comparison before the copy.
    """

    def __init__(self) -> None:
        self._pool: Optional[torch.Tensor] = None
        self.pinned = False
        self.allocations = 0
        self.layouts = 0
        """How many times views were carved (first save, and each save whose signature changed)."""
        self._layout: Optional[_Layout] = None
        self._last: Optional[Tuple[_Layout, List[torch.Tensor], List[torch.Tensor]]] = None
        """The layout, destinations and sources of the last CPU-only fill: what :meth:`recopy_last` copies."""
        self.adopted = 0
        """Saves whose copy was made by :meth:`recopy_last` during their encoding (no copy after it)."""

    @property
    def capacity(self) -> int:
        return 0 if self._pool is None else self._pool.numel()

    def stage(self, tensors: Mapping[str, torch.Tensor], algorithm: Optional[str] = None) -> StagedTensors:
        """Copy ``tensors`` into the pool and return them as contiguous CPU views of it.

        The views stay valid until the next ``stage`` or ``release``; the caller must not stage again
        while a writer still reads them. ``algorithm``: see :meth:`fill`.
        """
        staged = self.prepare(tensors)
        self.fill(staged, tensors, algorithm)
        return staged

    def prepare(self, tensors: Mapping[str, torch.Tensor]) -> StagedTensors:
        """Views of the pool laid out as the file's data section, in file order, not yet holding their bytes.

        The views of the previous save are reused when the signature is the same (the usual case: the
        same model every time), which keeps their construction off the training thread's clock.
        """
        signature = _signature(tensors)
        layout = self._layout
        if layout is None or layout.signature != signature:
            layout = self._carve(signature, tensors)
        return StagedTensors(layout.views, layout.image, layout.index)

    def _carve(self, signature: Tuple, tensors: Mapping[str, torch.Tensor]) -> _Layout:
        entries = framing.layout(tensors)
        size = _blocks(entries[-1].end if entries else 0)
        self._ensure(size, pinned=any(cuda for *_, cuda in signature))
        views = {}
        for e in entries:
            t = tensors[e.name]
            views[e.name] = (
                self._pool_bytes(e.end)[e.begin :].view(t.dtype).view(t.shape)
                if e.end > e.begin
                else torch.empty(t.shape, dtype=t.dtype)
            )
        image = memoryview(self._pool_bytes(size).numpy().data)
        self._layout = _Layout(signature, views, {name: i for i, name in enumerate(views)}, image)
        self.layouts += 1
        return self._layout

    def _pool_bytes(self, n: int) -> torch.Tensor:
        assert self._pool is not None
        return self._pool[:n]

    def fill(self, staged: StagedTensors, tensors: Mapping[str, torch.Tensor], algorithm: Optional[str] = None) -> None:
        """Copy ``tensors`` into ``staged`` in file order, releasing each stretch to readers as it is copied.

        CPU tensors are copied in batches of up to ``NOTIFY_BYTES`` with one call each (no Python work
        per tensor beyond a list entry); CUDA copies are queued non-blocking and released together
        after one synchronisation per device. With ``algorithm`` (an ``integrity`` digest name), each
        tensor's digest is computed right after its copy and left in ``staged.digests``, so the writer
        needs no pass over memory of its own (at the price of a longer copy). If a copy raises, readers
        get ``StagingAborted`` and the error propagates here.
        """
        self._last = None
        try:
            with torch.no_grad():
                filler = _Filler(staged, algorithm)
                filler.run(tensors)
        except BaseException as err:
            staged._abort(err)
            raise
        staged._copied_up_to(len(staged), notify=True)
        if not filler.devices and algorithm is None and self._layout is not None:
            self._last = (self._layout, list(staged.values()), [tensors[name] for name in staged])

    def recopy_last(self) -> Optional[_Recopy]:
        """Start copying the sources of the last fill into the same places again, on a helper thread.

        Meant to run while the caller encodes the next checkpoint (Python work that holds the GIL; the
        copy is one C call that releases it): a model saved again usually has the very same tensors, so
        :meth:`adopt` can then take this copy instead of copying after the encoding. ``None`` when there
        is nothing to recopy (first save, CUDA sources, hashing during the copy). The caller must not
        touch the pool before :meth:`adopt` (or ``join``) returns.
        """
        return None if self._last is None else _Recopy(*self._last)

    def adopt(self, recopy: Optional[_Recopy], staged: StagedTensors, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Wait for ``recopy``; if it copied exactly what :meth:`fill` of ``tensors`` would, mark ``staged``
        copied and return ``True``; else ``False`` (the caller then fills).

        Exactly: the same layout object (same names, dtypes, shapes) and, per tensor, the same memory
        seen the same way (data pointer, strides, conjugate and negative bits). The sources of the last
        fill are kept referenced, so a pointer equal to one of theirs cannot be reused memory.
        """
        if recopy is None:
            return False
        recopy.join()
        if not recopy.ok or recopy.layout is not self._layout or len(tensors) != len(recopy.srcs):
            return False
        for old, name in zip(recopy.srcs, staged, strict=True):
            new = tensors[name]
            if not _same_view(old, new):
                return False
        staged._copied_up_to(len(staged), notify=True)
        self.adopted += 1
        return True

    def release(self) -> None:
        self._pool, self._layout, self._last = None, None, None

    def reserve(self, nbytes: int, pinned: bool = False) -> None:
        """Allocate the pool for a data section of about ``nbytes`` and touch every page of it now.

        Fresh memory costs a page fault per page at first touch; done here, ahead of time and off the
        training thread, the first snapshot blocks for a copy only (a snapshot that needs more than was
        reserved reallocates, as without a reservation)."""
        size = _blocks(nbytes)
        if self._pool is not None and self.capacity >= size and (self.pinned or not pinned):
            return
        self._layout = None
        self._ensure(size, pinned)
        assert self._pool is not None
        self._pool.zero_()

    def _ensure(self, nbytes: int, pinned: bool) -> None:
        if self._pool is not None and self.capacity >= nbytes and (self.pinned or not pinned):
            return
        self._pool, self._layout = None, None  # drop the old pool before allocating the new one: never two at once
        self._pool = _block_aligned(_allocate(nbytes + BLOCK, pinned), nbytes)
        self.pinned = pinned
        self.allocations += 1


class _Filler:
    """One :meth:`HostBuffers.fill`: batches of CPU copies, queued CUDA copies, in-order release."""

    def __init__(self, staged: StagedTensors, algorithm: Optional[str]) -> None:
        self.staged, self.algorithm = staged, algorithm
        self.limit = NOTIFY_BYTES if algorithm is None else min(NOTIFY_BYTES, HASH_BATCH_BYTES)
        self.names: List[str] = []  # the batch: copied together by one call
        self.dsts: List[torch.Tensor] = []
        self.srcs: List[torch.Tensor] = []
        self.batched = 0  # bytes in the batch
        self.unreleased = 0  # bytes copied since readers were last woken
        self.devices: set = set()
        self.from_cuda: List[str] = []
        if algorithm is not None:
            staged.digests = {}

    def run(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for i, (name, dst) in enumerate(self.staged.items()):  # file order
            t = tensors[name]
            if _is_cuda(t):
                self.flush(i)
                dst.copy_(t, non_blocking=True)
                self.devices.add(t.device)
                self.from_cuda.append(name)
                continue
            self.names.append(name)
            self.dsts.append(dst)
            self.srcs.append(t)
            nbytes = t.numel() * t.element_size()
            self.batched += nbytes
            self.unreleased += nbytes
            if self.batched >= self.limit:
                self.flush(i + 1)
        self.flush(len(self.staged))
        for device in self.devices:  # one synchronisation per device, after every copy was queued
            _synchronize(device)
        self._hash(self.from_cuda)  # their bytes are there only now

    def flush(self, copied: int) -> None:
        """Copy (and hash) the batch; release tensors ``[0, copied)`` unless a CUDA copy is still queued."""
        if self.dsts:
            _copy_batch(self.dsts, self.srcs)
            self._hash(self.names)
            self.names, self.dsts, self.srcs, self.batched = [], [], [], 0
        if not self.devices:  # released in order: nothing after a queued CUDA copy until the sync
            notify = self.unreleased >= NOTIFY_BYTES
            self.staged._copied_up_to(copied, notify)
            self.unreleased = 0 if notify else self.unreleased

    def _hash(self, names: Sequence[str]) -> None:
        digests, algorithm = self.staged.digests, self.algorithm
        if digests is None or algorithm is None:
            return
        for name in names:
            digests[name] = integrity.digest(algorithm, framing.host_bytes(self.staged[name]))


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.stride() == b.stride()
        and a.is_conj() == b.is_conj()
        and a.is_neg() == b.is_neg()
        and not b.is_cuda
    )


class _Recopy:
    """:meth:`HostBuffers.recopy_last` in flight: one batched copy on a helper thread."""

    def __init__(self, layout: _Layout, dsts: List[torch.Tensor], srcs: List[torch.Tensor]) -> None:
        self.layout, self.srcs, self.ok = layout, srcs, False
        self._thread = threading.Thread(target=self._run, args=(dsts, srcs), name="lightning-resume-recopy")
        self._thread.start()

    def _run(self, dsts: List[torch.Tensor], srcs: List[torch.Tensor]) -> None:
        try:
            with torch.no_grad():
                _copy_batch(dsts, srcs)
            self.ok = True
        except BaseException as err:  # noqa: BLE001 - the caller then copies the usual way
            log.debug("recopy of the last snapshot failed, copying after encoding instead: %s", err)

    def join(self) -> None:
        self._thread.join()


def _copy_batch(dsts: List[torch.Tensor], srcs: List[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair; many pairs in one call (the per-tensor cost is then in C++)."""
    if len(dsts) == 1:
        dsts[0].copy_(srcs[0])
    else:
        foreach_copy_(dsts, srcs)


def _blocks(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def _block_aligned(raw: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The ``nbytes`` of ``raw`` (allocated ``BLOCK`` bytes larger) that start on a ``BLOCK`` boundary."""
    skip = -raw.data_ptr() % BLOCK
    return raw[skip : skip + nbytes]


# ------------------------------------------------------------------------------------ writer priority

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


# ------------------------------------------------------------------------------------ ordered writer


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
        except BaseException as err:  # noqa: BLE001 - handed to the training thread by AsyncSaver; never lost
            job.error = err
        job.seconds = time.monotonic() - started


# ------------------------------------------------------------------------------------ the saver


WriteFn = Callable[[str, str, StagedTensors], None]
"""``write(path, tree_json, staged)``: the durable commit (``write.commit`` with a digest), reading each
tensor only after ``staged.wait(name)``: it starts while the snapshot is still being copied."""


class AsyncSaver:
    """Snapshot on the caller's thread, write on the worker; at most one save in flight.

    ``overlap=True`` starts the write while the snapshot is still being copied (each chunk once it is
    copied): the file is durable sooner by about the copy time, but the write then competes with the
    copy for CPU and memory bandwidth, so the caller is blocked longer. Off by default: blocking is what
    training pays.

    ``encode(checkpoint) -> (tree_json, tensors)`` runs on the caller's thread, ``write`` on the worker.
    A failed job is reported on the caller's thread by the next :meth:`save`, :meth:`wait` or
    :meth:`report`: raised as ``AsyncWriteError`` (``on_error="raise"``) or warned (``"warn"``).
    """

    def __init__(
        self,
        encode: Callable[[dict], Tuple[str, Dict[str, torch.Tensor]]],
        write: WriteFn,
        on_error: str = "raise",
        overlap: bool = False,
    ) -> None:
        self._encode = encode
        self._write = write
        self.on_error = on_error
        self.overlap = overlap
        self.buffers = HostBuffers()
        self.writer = OrderedWriter()
        self._last_write: Optional[Job] = None
        self.last_wait_seconds = 0.0
        self.last_blocked_seconds = 0.0
        self._write_seconds: Optional[float] = None

    @property
    def last_write_seconds(self) -> Optional[float]:
        """Worker time of the newest write that completed (``None`` before the first)."""
        job = self._last_write
        if job is not None and job.done.is_set() and job.error is None:
            self._write_seconds = job.seconds
        return self._write_seconds

    def save(self, checkpoint: dict, path: str) -> None:
        """Wait for the previous save (measured), report its failure, snapshot ``checkpoint``, queue its write.

        Returns once every tensor is copied, so the caller may then change its state freely. With
        ``overlap`` the write is queued before the copy starts and follows it chunk by chunk.
        """
        started = time.monotonic()
        self.writer.wait(self.writer.outstanding())  # the pool is reused: the previous write must be done
        snapshot_start = time.monotonic()
        self.last_wait_seconds = snapshot_start - started
        self.report()
        recopy = None if self.overlap else self.buffers.recopy_last()  # the same tensors, copied meanwhile
        try:
            tree_json, tensors = self._encode(checkpoint)  # unencodable values fail here, before any file
        finally:
            if recopy is not None:
                recopy.join()  # nothing touches the pool while it is being copied into
        staged = self.buffers.prepare(tensors)
        job = Job("write", path, lambda: self._write(path, tree_json, staged))
        if self.overlap:
            self._fill_while_writing(staged, tensors, job)
        else:
            if not self.buffers.adopt(recopy, staged, tensors):
                self.buffers.fill(staged, tensors)
            self.writer.submit(job)
        self.last_blocked_seconds = time.monotonic() - snapshot_start
        self._last_write = job

    def _fill_while_writing(self, staged: StagedTensors, tensors: Mapping[str, torch.Tensor], job: Job) -> None:
        self.writer.submit(job)
        try:
            self.buffers.fill(staged, tensors)
        except BaseException:
            self.writer.wait([job])  # the write stops at the first byte not copied and leaves no file
            self.writer.discard(job)  # the caller gets the copy's own error, now; not a second one later
            raise

    def reserve(self, nbytes: int, pinned: bool = False) -> None:
        """Prepare the pool for snapshots of about ``nbytes`` on the worker (at its lowered priority), so the
        first save blocks for a copy, not for page faults; returns at once (a save waits for it). A
        reservation that fails (no memory) is logged and leaves the first save to allocate, as before."""

        def run() -> None:
            try:
                self.buffers.reserve(nbytes, pinned)
            except (MemoryError, RuntimeError) as err:  # torch reports a failed allocation as RuntimeError
                log.warning("lightning-resume: could not reserve %d bytes of staging memory ahead: %s", nbytes, err)

        self.writer.submit(Job("reserve", "", run))

    def remove(self, path: str, remove: Callable[[], None]) -> None:
        """Queue a deletion after everything submitted so far (skipped if the write before it failed)."""
        self.writer.submit(Job("remove", path, remove, after=self._last_write))

    def in_flight(self, path: Optional[str] = None) -> bool:
        return bool(self.writer.outstanding(path, kind="write"))

    def wait(self, path: Optional[str] = None, timeout: Optional[float] = None) -> bool:
        """Until ``path``'s writes (or every job) are done, then :meth:`report`; ``False`` on timeout."""
        jobs = self.writer.outstanding(path, kind="write") if path is not None else self.writer.outstanding()
        done = self.writer.wait(jobs, timeout)
        self.report()
        return done

    def report(self, on_error: Optional[str] = None) -> None:
        """Hand every failure since the last report to this thread: raise the first, warn the others."""
        errors = [AsyncWriteError(j.path, j.error, j.kind) for j in self.writer.take_failed() if j.error is not None]
        raising = (on_error or self.on_error) == "raise" and errors
        for err in errors[1:] if raising else errors:
            warnings.warn(str(err), AsyncWriteWarning, stacklevel=3)
        if raising:
            raise errors[0] from errors[0].cause
