"""The async save protocol: snapshot on the caller's thread, commit on one ordered worker.

Two phases, in order. On the caller's (training) thread, :class:`AsyncSaver` encodes the checkpoint
(an unencodable value fails there, before any file is touched; ``codec.TreeEncoder`` reuses the last
save's encoding while the tree keeps its signature) and copies its tensors into the reusable host pool
of ``buffers.HostBuffers`` (while a tree is encoded in full, the last save's tensors are copied again
meanwhile, on a helper thread, and taken where they are still the same memory); once
:meth:`AsyncSaver.save` returns nothing the next optimizer step mutates is referenced. On the worker
(``worker.OrderedWriter``) the staged bytes are committed (:func:`commit_staged`: ``write.commit``,
atomic and checksummed, with direct I/O from the pool where the filesystem allows), then the deletions
asked for after it run, in order. At most one save is in flight (the next waits for it, and that wait is
measured); a worker's error is handed to the caller's thread at the next save, at :meth:`AsyncSaver.wait`
or at :meth:`AsyncSaver.close`, never lost. This module knows tensors, threads and files, not Lightning.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Literal, Optional, Tuple

import torch

from lightning_resume._compat.torch_ops import versions, without_function_modes
from lightning_resume.errors import AsyncWriteError, AsyncWriteWarning
from lightning_resume.format import write
from lightning_resume.format.codec import TreeEncoder, TreeText
from lightning_resume.staging.buffers import HostBuffers, StagedTensors, _Recopy
from lightning_resume.staging.lending import BorrowedStaged, Lending, Offer
from lightning_resume.staging.overlap import CopyStats, OptimizerWatch, OverlappedCopy, copy_now
from lightning_resume.staging.writer_process import SharedMemory, WriterProcess, refuse_process_local
from lightning_resume.storage import multipart
from lightning_resume.threads import Job, OrderedWriter

log = logging.getLogger(__name__)

WriteFn = Callable[[str, str, StagedTensors], None]
"""``commit(path, tree_json, staged)``: the durable commit (:func:`commit_staged` with a digest), reading
each tensor only after ``staged.wait(name)``: it may start while the snapshot is still being copied."""


WriterKind = Literal["thread", "process"]
"""Where an async save's commit runs: on the saver's worker thread, or in a writer process of its own
(``staging.writer_process``: the training process then shares its GIL with no hashing or writing)."""


def commit_staged(
    path: str,
    tree_json: str,
    staged: StagedTensors,
    algorithm: str,
    mode: int = 0o666,
    upload: multipart.UploadOptions = multipart.DEFAULT_UPLOAD,
) -> None:
    """Commit a snapshot at ``path``: each tensor once copied, from the pool's image with direct I/O where allowed;
    in the writer process that maps the pool when the snapshot has one (``staged.writer``), once all is copied.
    ``upload``: part size and concurrency of a multi-part upload to an object store."""
    if staged.writer is not None:
        staged.writer.commit(path, tree_json, staged, algorithm, mode, (upload.part_size, upload.concurrency))
    else:
        write.commit(
            path, tree_json, staged, algorithm, ready=staged.wait, image=staged.image, mode=mode, upload=upload
        )


@dataclass
class SaverStats:
    """What the newest saves of an :class:`AsyncSaver` cost and did (timings in seconds)."""

    wait_seconds: float = 0.0
    """How long the newest save waited for the write before it (back-pressure)."""
    blocked_seconds: float = 0.0
    """The caller's time in the newest save: encoding the tree and copying (what it did not defer of) the tensors."""
    write_seconds: Optional[float] = None
    """Worker time of the newest write known to have completed."""
    borrowed_bytes: int = 0
    """Bytes the newest save took from another saver's snapshot instead of copying them (``borrow``)."""
    copy: Optional[CopyStats] = None
    """The newest overlapped copy that ended: bytes deferred, barrier time, recopies."""
    guarded: int = 0
    """In-place writes the copy-on-write guard held for a copy in flight, over every save."""
    recopied: int = 0
    """Tensors copied again at a barrier (changed unseen before their copy ended), over every save."""


class AsyncSaver:
    """Snapshot on the caller's thread, commit on the worker; at most one save in flight.

    ``commit`` runs on the worker (a :data:`WriteFn`), once the snapshot is copied. A failed job is reported
    on the caller's thread by the next :meth:`save`, :meth:`wait`, :meth:`report` or :meth:`close`: raised as
    ``AsyncWriteError`` (``on_error="raise"``) or warned (``"warn"``).

    ``overlapped=True`` copies at the save only what may change before the next optimizer step and the rest
    on a helper thread until then (``staging.overlap``); the write is handed over at that barrier.

    ``writer="process"``: the pool is shared memory and ``commit_staged`` hands each write to a writer
    process (``staging.writer_process``), started with the saver and again after it ended; the worker thread
    only waits for it. :meth:`close` ends the writer process too.

    :meth:`lend_staging` keeps an offer of each snapshot (``staging.lending``), from which another saver's
    :meth:`save_text` given ``borrow=`` takes the tensors it shares, instead of copying them again.
    """

    def __init__(
        self,
        commit: WriteFn,
        on_error: str = "raise",
        overlapped: bool = False,
        writer: WriterKind = "thread",
    ) -> None:
        if writer not in ("thread", "process"):
            raise ValueError(f"writer={writer!r} is not supported; use 'thread' or 'process'")
        self._commit = commit
        self.on_error = on_error
        self.watch = OptimizerWatch() if overlapped else None
        self._copy: Optional[OverlappedCopy] = None
        self.stats = SaverStats()
        self.process: Optional[WriterProcess] = None
        """With ``writer="process"``: the handle on the writer process (its ``pid``, how many were ``started``)."""
        if writer == "process":
            shared = SharedMemory()
            self.buffers = HostBuffers(shared)
            self.process = WriterProcess(shared)
            shared.before_allocate = self.process.drop_pools
            self.process.start()  # it imports torch while training goes on; the first write waits for it
        else:
            self.buffers = HostBuffers()
        self.encoder = TreeEncoder()
        self.writer = OrderedWriter()
        self._last_write: Optional[Job] = None
        self._held: Optional[List[Job]] = None  # an overlapped snapshot's write, and what follows it, until its barrier
        self._lend = False
        self.offer: Optional[Offer] = None
        """After :meth:`lend_staging`: the newest snapshot, for another saver to take its tensors from."""
        self._borrowers: List[Job] = []  # other savers' writes that read this pool
        self._borrowed: Optional[Offer] = None  # the offer this saver's newest write reads from
        self._after_barrier: List[Callable[[], None]] = []  # borrowers' hand-overs waiting for this copy

    @property
    def overlapped(self) -> bool:
        """Whether saves defer the copy of the optimizer-stepped state to the next optimizer step."""
        return self.watch is not None

    def lend_staging(self) -> Lending:
        """Keep an :attr:`offer` of each snapshot from now on; the handle another saver reads it through."""
        self._lend = True
        return Lending(self.overlapped, lambda: self.offer)

    @property
    def last_write_seconds(self) -> Optional[float]:
        """Worker time of the newest write that completed (``None`` before the first)."""
        job = self._last_write
        if job is not None and job.done.is_set() and job.error is None:
            self.stats.write_seconds = job.seconds
        return self.stats.write_seconds

    def save(self, checkpoint: dict, path: str) -> None:
        """Wait for the previous save (measured), report its failure, snapshot ``checkpoint``, queue its commit.

        Returns once every tensor is copied (``overlapped``: every tensor the next forward may change), so the
        caller may then change its state freely.
        """
        self._save(path, checkpoint=checkpoint)

    def encode(self, checkpoint: dict) -> TreeText:
        """``checkpoint`` encoded as :meth:`save` encodes it: the kept encoding reused while the tree keeps its
        signature (only its tensor-free subtrees encoded), else in full. Hand the result to :meth:`save_text`."""
        with without_function_modes():  # an overlapped copy's guard would see every metadata read
            return self.encoder.reuse(checkpoint) or self.encoder.encode_in_full(checkpoint)

    def save_text(self, encoded: TreeText, path: str, borrow: Optional[Offer] = None) -> None:
        """:meth:`save` of a checkpoint encoded by :meth:`encode` (e.g. to size it first), just before: its
        layout is kept, so the snapshot costs what a :meth:`save` of the same tree costs.

        ``borrow``: another saver's :attr:`offer` of a snapshot of the same state at the same point; the
        tensors it holds are written from its pool, not copied (``staging.lending``), the others are copied now."""
        self._save(path, encoded=encoded, borrow=borrow)

    def _save(
        self,
        path: str,
        checkpoint: Optional[dict] = None,
        encoded: Optional[TreeText] = None,
        borrow: Optional[Offer] = None,
    ) -> None:
        if self.process is not None:
            refuse_process_local(path)
        started = time.monotonic()
        self.end_copy()  # the previous snapshot's deferred copy (normally ended by the optimizer step before)
        self.writer.wait(self.writer.outstanding())  # the pool is reused: the previous write must be done
        self.offer = None
        self._wait_borrowers()  # and so must every other saver's write that reads it
        snapshot_start = time.monotonic()
        self.stats.wait_seconds = snapshot_start - started
        self.report()
        with without_function_modes():  # a lender's copy guards this thread: its guard sees none of this
            encoded, recopy = self._encode(checkpoint, encoded)
            tree_json, tensors = encoded.tree_json, encoded.tensors
            staged = self.buffers.prepare(tensors, encoded.layout)
            taken = borrow.match(tensors) if borrow is not None and self.process is None else {}
            if taken:
                assert borrow is not None
                staged = self._borrowing(staged, tensors, taken, borrow)
        staged.writer = self.process
        job = Job("write", path, lambda: self._commit(path, tree_json, staged))
        self.stats.borrowed_bytes, self._borrowed = 0, None
        if self._lend:
            self.offer = Offer(
                staged, tensors, versions(tensors.values()), self.end_copy, self.when_copied, self._borrowers
            )
        if taken:
            assert borrow is not None and isinstance(staged, BorrowedStaged)
            borrow.borrowers.append(job)
            self._borrowed, self.stats.borrowed_bytes = borrow, staged.borrowed_bytes
            self._held = [job]  # handed over once the lender's copy is over, as the lender's own write is
            borrow.when_copied(self._submit_held)
        elif self.watch is not None:
            self._copy_overlapped(staged, tensors, job)
        else:
            if not self.buffers.adopt(recopy, staged, tensors):
                self.buffers.fill(staged, tensors, encoded.pointers, encoded.plain)
            self._submit(job)
        self.stats.blocked_seconds = time.monotonic() - snapshot_start
        self._last_write = job

    def _encode(self, checkpoint: Optional[dict], encoded: Optional[TreeText]) -> Tuple[TreeText, Optional[_Recopy]]:
        """``checkpoint`` encoded (unless given ``encoded``), and the recopy of the last save's tensors made
        meanwhile when it was encoded in full (long Python work)."""
        recopy = None
        if encoded is None:
            encoded = self.encoder.reuse(checkpoint)  # the usual save: only its tensor-free subtrees encoded
        if encoded is None:  # encoded in full: long Python work, so the same tensors are copied meanwhile
            recopy = None if self.watch is not None else self.buffers.recopy_last()
            try:
                encoded = self.encoder.encode_in_full(checkpoint)  # unencodable values fail here, before any file
            finally:
                if recopy is not None:
                    recopy.join()  # nothing touches the pool while it is being copied into
        return encoded, recopy

    def _copy_overlapped(self, staged: StagedTensors, tensors: Dict[str, torch.Tensor], job: Job) -> None:
        """Copy now what may change before the next optimizer step; defer the rest (``staging.overlap``)."""
        assert self.watch is not None
        names = list(staged)
        with without_function_modes():
            now, later = self.watch.split(staged, tensors)
            try:
                if now:
                    copy_now([staged[names[i]] for i in now], [tensors[names[i]] for i in now], self.buffers.devices)
            except BaseException as err:
                staged._abort(err)
                raise
        staged._copied_up_to(later[0] if later else len(staged), notify=True)
        if not later:
            self._submit(job)
            return
        copy = OverlappedCopy(staged, [tensors[names[i]] for i in later], later, self.buffers.devices)
        copy.on_end = self._copy_ended
        copy.after_barrier = self._submit_held
        copy.stats.sync_bytes = sum(staged[names[i]].numel() * staged[names[i]].element_size() for i in now)
        self._held = [job]  # handed to the worker at the barrier: waking it now would take the GIL from the save
        try:
            copy.start()
        except BaseException as err:
            self._held = None
            staged._abort(err)
            raise
        self._copy = copy

    def _borrowing(
        self, own: StagedTensors, tensors: Dict[str, torch.Tensor], taken: Dict[str, str], offer: Offer
    ) -> BorrowedStaged:
        """The snapshot with ``taken`` read from ``offer``'s pool; the rest copied into this pool now."""
        rest = [name for name in own if name not in taken]
        copy_now([own[n] for n in rest], [tensors[n] for n in rest], self.buffers.devices)  # nothing reads them yet
        staged = BorrowedStaged(own, offer.staged, taken)
        staged._copied_up_to(len(staged), notify=False)
        return staged

    def _wait_borrowers(self) -> None:
        """Until no other saver's write reads this pool."""
        for job in list(self._borrowers):
            job.done.wait()
            self._borrowers.remove(job)

    def end_copy(self) -> Optional[CopyStats]:
        """The barrier of the snapshot whose copy is still running (``overlapped``): wait for it, copy again
        what changed unseen; its stats, or ``None`` when no copy was running. Also run by the next optimizer
        step, save, :meth:`wait` and :meth:`close`."""
        copy, self._copy = self._copy, None
        if self._held is not None and self._borrowed is not None:
            self._borrowed.end_copy()  # the write held for a lender's copy: the lender's barrier hands it over
        return None if copy is None else copy.finish()

    def when_copied(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the newest snapshot is copied: at its barrier (``overlapped``), else now."""
        if self._copy is not None and not self._copy.finished:
            self._after_barrier.append(callback)
        else:
            callback()

    def _submit(self, job: Job) -> None:
        """Queue ``job`` on the worker, or behind an overlapped snapshot's write not handed over yet (order kept)."""
        if self._held is not None:
            self._held.append(job)
        else:
            self.writer.submit(job)

    def _submit_held(self) -> None:
        held, self._held = self._held, None
        for job in held or ():
            self.writer.submit(job)
        callbacks, self._after_barrier = self._after_barrier, []
        for callback in callbacks:
            callback()

    def _copy_ended(self, stats: CopyStats) -> None:
        self.stats.copy = stats
        self.stats.guarded += stats.guarded
        self.stats.recopied += len(stats.recopied)

    def reserve(self, nbytes: int, pinned: bool = False) -> None:
        """Prepare the pool for snapshots of about ``nbytes`` on the worker (at its lowered priority), so the
        first save blocks for a copy, not for page faults; returns at once (a save waits for it). A
        reservation that fails (no memory) is logged and leaves the first save to allocate, as before."""

        def run() -> None:
            self._wait_borrowers()  # a larger pool replaces this one
            try:
                self.buffers.reserve(nbytes, pinned)
            except (MemoryError, RuntimeError) as err:  # torch reports a failed allocation as RuntimeError
                log.warning("lightning-resume: could not reserve %d bytes of staging memory ahead: %s", nbytes, err)

        self._submit(Job("reserve", "", run))

    def remove(self, path: str, remove: Callable[[], None]) -> None:
        """Queue a deletion after everything submitted so far (skipped if the write before it failed)."""
        self._submit(Job("remove", path, remove, after=self._last_write))

    def _writes(self, path: Optional[str] = None) -> List[Job]:
        """The writes queued or running and the one held until its barrier, oldest first."""
        held = [j for j in self._held or () if j.kind == "write" and (path is None or j.path == path)]
        return self.writer.outstanding(path, kind="write") + held

    def in_flight(self, path: Optional[str] = None) -> bool:
        return bool(self._writes(path))

    def pending(self) -> List[str]:
        """The paths of the writes queued, running or held until their barrier, oldest first."""
        return [j.path for j in self._writes()]

    def wait(self, path: Optional[str] = None, timeout: Optional[float] = None, on_error: Optional[str] = None) -> bool:
        """Until ``path``'s writes (or every job) are done, then :meth:`report` (per ``on_error`` when given);
        ``False`` on timeout."""
        self.end_copy()
        jobs = self.writer.outstanding(path, kind="write") if path is not None else self.writer.outstanding()
        done = self.writer.wait(jobs, timeout)
        self.report(on_error)
        return done

    def close(self) -> None:
        """Wait for every job, report a failure, and give the pool's memory back (the next save allocates again);
        a writer process exits (the next save starts another)."""
        try:
            self.wait()
        finally:
            if self.process is not None and not self.writer.outstanding():
                self.process.close()  # idle: it unmaps the pool and exits
        self.offer = None
        self._wait_borrowers()  # another saver's write still reads the pool
        self.buffers.release()

    def report(self, on_error: Optional[str] = None) -> None:
        """Hand every failure since the last report to this thread: raise the first, warn the others."""
        errors = [AsyncWriteError(j.path, j.error, j.kind) for j in self.writer.take_failed() if j.error is not None]
        raising = (on_error or self.on_error) == "raise" and errors
        for err in errors[1:] if raising else errors:
            warnings.warn(str(err), AsyncWriteWarning, stacklevel=3)
        if raising:
            raise errors[0] from errors[0].cause
