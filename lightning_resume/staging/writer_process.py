"""The writer process: an async save's commit (writing and hashing) in a process of its own.

With ``SafetensorsCheckpointIO(writer="process")`` the staging pool of
``buffers.HostBuffers`` is anonymous shared memory (:class:`SharedMemory`: a ``memfd``, no name in any
directory, so no other user can open it and nothing is left behind by a crash), and the commit of each
save runs in one long-lived writer process per saver, which maps the same memory and calls the same
``write.commit`` (atomic, checksummed, direct I/O; fsspec URLs through the same storage layer). The
training process keeps one thread per saver (``worker.OrderedWriter``) that only waits: for the snapshot
copy, then on the pipe for the writer's answer, so the training thread shares the GIL with nothing that
hashes or writes.

:class:`WriterProcess` is the training process's side: it starts the writer (``python -c`` :data:`_LAUNCH`: a
fresh interpreter that imports neither the user's ``__main__`` nor Lightning, never a ``fork`` of a process
with threads or CUDA), hands it the pool's file descriptor once per allocation (``SCM_RIGHTS``) and each
layout once, then one small message per save, and waits for ``done`` or the writer's own error. The
writer runs at lowered CPU and I/O priority (``worker.lower_thread_priority``) and ignores SIGINT, SIGTERM
and SIGHUP (sent to a whole process group by a terminal or a scheduler; the trainer decides what they
mean): if the trainer dies during a write, the writer still completes and commits it, then sees the
pipe's end and exits. If the writer dies, the write it was given fails with ``errors.WriterProcessDied``
(naming its pid and how it ended; raised as ``AsyncWriteError`` at the next save or teardown), its
temporary is removed, and the next write starts a new writer. This module knows processes, memory and
files; not Lightning, and nothing about what is saved.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
import weakref
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from lightning_resume.errors import WriterProcessDied
from lightning_resume.staging.buffers import Devices, Placement, StagedTensors
from lightning_resume.threads import WRITER_NICE

_LAUNCH = (
    "import sys\n"
    "from lightning_resume.threads import lower_thread_priority\n"
    "lower_thread_priority(int(sys.argv[2]))\n"  # before importing torch: that takes a core for a second
    "from lightning_resume.staging.writer_process import main\n"
    "sys.exit(main(sys.argv))\n"
)
"""The writer's entry: a fresh interpreter (never the user's ``__main__``), at lowered priority from its start."""

CLOSE_TIMEOUT_S = 30.0
"""How long :meth:`WriterProcess.close` waits for an idle writer to exit after its pipe is closed."""


class _Mapping(mmap.mmap):
    """A shared mapping of the pool's memory file; ``fd`` stays open while the mapping lives (a restarted
    writer is handed it again), ``base`` is the address of its first byte."""

    fd: int
    base: int
    key: int


def _anonymous_file(nbytes: int) -> int:
    """A file descriptor of ``nbytes`` of memory that no path names: ``memfd_create`` (Linux), else a
    temporary file unlinked at once."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("lightning-resume-staging", os.MFD_CLOEXEC)
    else:  # pragma: no cover - macOS and the BSDs
        import tempfile

        fd, path = tempfile.mkstemp(prefix="lightning-resume-staging-")
        os.unlink(path)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


_MAPPINGS = itertools.count(1)


class SharedMemory(Devices):
    """:class:`buffers.Devices` whose pool is shared memory a writer process can map (:meth:`find`).

    Pinned pools (CUDA sources) are page-locked with ``cudaHostRegister`` where CUDA is present; where that
    fails the pool stays pageable (copies then wait for the host instead of running as DMA).
    """

    def __init__(self) -> None:
        self._mappings: weakref.WeakValueDictionary[int, _Mapping] = weakref.WeakValueDictionary()
        self.before_allocate: Optional[Callable[[], None]] = None
        """Called before each new pool (``WriterProcess.drop_pools``: never two pools' memory at once)."""

    def allocate(self, nbytes: int, pinned: bool) -> torch.Tensor:
        if self.before_allocate is not None:
            self.before_allocate()
        fd = _anonymous_file(max(nbytes, 1))
        try:
            mapping = _Mapping(fd, max(nbytes, 1))
        except BaseException:
            os.close(fd)
            raise
        mapping.fd, mapping.key = fd, next(_MAPPINGS)
        weakref.finalize(mapping, os.close, fd)
        pool = torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes]  # keeps the mapping alive
        mapping.base = pool.data_ptr()
        self._mappings[mapping.key] = mapping
        if pinned and nbytes:
            _register_pinned(pool, mapping)
        return pool

    def find(self, pointer: int) -> Tuple[_Mapping, int]:
        """The mapping holding address ``pointer``, and the offset of it there."""
        for mapping in list(self._mappings.values()):
            if mapping.base <= pointer < mapping.base + len(mapping):
                return mapping, pointer - mapping.base
        raise LookupError(f"address {pointer:#x} is in no shared staging pool")


def _register_pinned(pool: torch.Tensor, mapping: _Mapping) -> None:
    """Page-lock ``pool`` for DMA from CUDA, unregistered when ``mapping`` goes (before it is unmapped: a
    weak reference's callback runs before the object is freed); a no-op without CUDA. Not yet run on a GPU."""
    if not torch.cuda.is_available():
        return
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(pool.data_ptr(), pool.numel(), 0)) != 0:
        return  # stays pageable: still correct
    weakref.finalize(mapping, cudart.cudaHostUnregister, pool.data_ptr())


class WriterProcess:
    """The training process's handle on one writer process: start it, give it work, notice its end.

    :meth:`commit` runs on the saver's worker thread (one at a time); :meth:`start` and :meth:`close` on
    the caller's. ``nice``: how far below the training process's CPU priority the writer runs.
    """

    def __init__(self, devices: SharedMemory, nice: int = WRITER_NICE) -> None:
        self.devices, self.nice = devices, nice
        self._lock = threading.Lock()
        self._talk = threading.Lock()  # one conversation on the pipe at a time
        self._proc: Optional[subprocess.Popen] = None
        self._conn: Optional[Connection] = None
        self._segments: Set[int] = set()  # keys of the pools this writer was handed
        self._layouts: Set[int] = set()  # placement keys this writer was told
        self.started = 0
        """How many writer processes this handle started (1 unless one died or was closed)."""

    @property
    def pid(self) -> Optional[int]:
        """The current writer's process id (``None`` before it starts or after it ended)."""
        proc = self._proc
        return None if proc is None else proc.pid

    def start(self) -> None:
        """Start the writer if none is running (it imports torch meanwhile; the first write waits for it)."""
        with self._lock:
            if self._proc is not None:
                return
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                args = [sys.executable, "-c", _LAUNCH, str(theirs.fileno()), str(self.nice)]
                self._proc = subprocess.Popen(args, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            self._conn = Connection(ours.detach())
            self._segments, self._layouts = set(), set()
            self.started += 1

    def commit(
        self,
        path: str,
        tree_json: str,
        staged: StagedTensors,
        algorithm: str,
        mode: int,
        upload: Tuple[int, int] = (16 << 20, 8),
    ) -> None:
        """Once ``staged`` is copied, have the writer commit it at ``path``; return when it is durable.

        Raises the writer's own error for a write that failed there, and ``WriterProcessDied`` when the
        writer ended before it answered (its temporary removed). ``upload``: part size and concurrency of a
        multi-part upload (``storage.multipart.UploadOptions``), rebuilt in the writer."""
        names = list(staged)
        if names:
            staged.wait(names[-1])  # every tensor copied: the writer reads the pool, it cannot wait on a copy
        placement = staged.placement
        if placement is None or staged.image is None:
            raise ValueError("internal error: a snapshot for the writer process has no placement in a shared pool")
        self.start()
        proc, conn = self._proc, self._conn
        assert proc is not None and conn is not None
        try:
            with self._talk:
                self._describe(conn, placement)
                conn.send(("write", path, tree_json, algorithm, mode, placement.key, upload))
                answer = conn.recv()
        except (EOFError, OSError) as err:
            raise self._died(proc, path) from err
        if answer[0] == "error":
            raise answer[1]

    def _describe(self, conn: Connection, placement: Placement) -> None:
        """Hand the writer the pool holding ``placement`` and the layout itself, each the first time only."""
        mapping, offset = self.devices.find(placement.pointer)
        if mapping.key not in self._segments:
            conn.send(("segment", mapping.key, len(mapping)))
            send_handle(conn, mapping.fd, -1)  # the pid is unused on POSIX (SCM_RIGHTS over the socket)
            self._segments = {mapping.key}  # the writer keeps only the newest pool
            self._layouts = set()
        if placement.key not in self._layouts:
            conn.send(("layout", placement.key, mapping.key, offset, placement.size, placement.entries))
            self._layouts.add(placement.key)

    def drop_pools(self) -> None:
        """Have the writer unmap the pools it was handed (the trainer is about to allocate another, with no
        write in flight), so their memory is freed now rather than at the next write."""
        with self._talk:
            conn = self._conn
            if conn is None or not self._segments:
                return
            with contextlib.suppress(OSError):  # a dead writer: the next commit finds out and says so
                conn.send(("drop",))
            self._segments, self._layouts = set(), set()

    def _died(self, proc: subprocess.Popen, path: str) -> WriterProcessDied:
        """The writer is gone: reap it, remove its temporary, forget it (the next write starts another)."""
        try:
            code: Optional[int] = proc.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # its pipe closed but it lives on: end it, it can write nothing now
            proc.kill()
            code = proc.wait()
        self._forget(proc)
        _remove_temporaries(path)
        return WriterProcessDied(proc.pid, code, path)

    def _forget(self, proc: subprocess.Popen) -> None:
        with self._lock:
            if self._proc is proc:
                if self._conn is not None:
                    self._conn.close()
                self._proc, self._conn = None, None

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Close the pipe; the writer, idle (the saver waited for its jobs), exits and unmaps the pool."""
        with self._lock:
            proc, conn = self._proc, self._conn
            self._proc, self._conn = None, None
        if conn is not None:
            conn.close()
        if proc is not None:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _remove_temporaries(path: str) -> None:
    """Remove the temporaries in ``path``'s directory of processes of this host that are gone (the dead
    writer's among them; ``atomic.clean_stale_temporaries``). A remote upload left incomplete is invisible
    and is cleaned by age later."""
    from lightning_resume.format.atomic import clean_stale_temporaries
    from lightning_resume.storage import files as storage

    if storage.is_local(path):
        directory = os.path.dirname(os.path.abspath(storage.local_path(path)))
        with contextlib.suppress(OSError):
            clean_stale_temporaries(directory)


def refuse_process_local(path: str) -> None:
    """Raise ``ValueError`` for a URL whose filesystem lives inside the training process (``memory://``):
    the writer process would write into a filesystem of its own that the trainer never sees."""
    from lightning_resume.storage import files as storage

    if storage.is_remote(path):
        import fsspec
        from fsspec.implementations.memory import MemoryFileSystem

        if isinstance(fsspec.core.url_to_fs(path)[0], MemoryFileSystem):
            raise ValueError(
                f"{path}: writer='process' cannot write to an in-process memory:// filesystem (the writer"
                " process has its own); use writer='thread'"
            )


# ---- the writer's side ---------------------------------------------------------------------------


class _Writer:
    """The writer process's state: the mapped pool and the layouts of it, by the trainer's keys."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.pools: Dict[int, Tuple[mmap.mmap, torch.Tensor]] = {}
        self.layouts: Dict[int, Tuple[int, int, int, Tuple[Any, ...]]] = {}

    def serve(self) -> None:
        """Answer messages until the trainer's end of the pipe closes (a write in progress completes first)."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return
            kind = message[0]
            if kind == "segment":
                self._map(message[1], message[2], recv_handle(self.conn))
            elif kind == "layout":
                self.layouts[message[1]] = message[2:]
            elif kind == "write":
                self._answer(self._write(*message[1:]))
            elif kind == "drop":
                self.pools.clear()
                self.layouts.clear()

    def _map(self, key: int, nbytes: int, fd: int) -> None:
        self.pools.clear()  # the trainer has one pool at a time: drop the last one's memory
        self.layouts.clear()
        try:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapped = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():  # read-only memory: torch warns that its tensors could write it
            warnings.simplefilter("ignore", UserWarning)
            self.pools[key] = (mapped, torch.frombuffer(mapped, dtype=torch.uint8))

    def _write(
        self, path: str, tree_json: str, algorithm: str, mode: int, layout_key: int, upload: Tuple[int, int]
    ) -> Tuple[Any, ...]:
        from lightning_resume.format import write
        from lightning_resume.storage import multipart

        started = time.monotonic()
        try:
            pool_key, offset, size, entries = self.layouts[layout_key]
            mapped, pool = self.pools[pool_key]
            tensors: Dict[str, torch.Tensor] = {}
            for name, dtype, shape, begin, end in entries:
                tensors[name] = (
                    pool[offset + begin : offset + end].view(dtype).view(shape)
                    if end > begin
                    else torch.empty(shape, dtype=dtype)
                )
            image = memoryview(mapped)[offset : offset + size]
            options = multipart.UploadOptions(*upload)
            write.commit(path, tree_json, tensors, algorithm, image=image, mode=mode, upload=options)
        except Exception as err:  # noqa: BLE001 - handed to the trainer, which raises it at the next save
            return ("error", _transferable(err))
        return ("done", time.monotonic() - started)

    def _answer(self, answer: Tuple[Any, ...]) -> None:
        with contextlib.suppress(OSError):  # the trainer is gone: the file is committed all the same
            self.conn.send(answer)


def _transferable(err: BaseException) -> BaseException:
    """``err`` if it survives pickling (most do: ``OSError``, our errors), else a ``RuntimeError`` with its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001 - any failure to round-trip: send the text
        return RuntimeError(f"{type(err).__name__}: {err}")


def main(argv: List[str]) -> int:
    """The writer: ``argv`` is ``[_, FD, NICE]``; serve the trainer on socket ``FD`` (:data:`_LAUNCH`)."""
    fd = int(argv[1])  # argv[2], the priority, was applied by the launcher before it imported torch
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the trainer's to handle; a write in flight completes
    torch.set_num_threads(1)
    _Writer(Connection(fd)).serve()
    return 0
