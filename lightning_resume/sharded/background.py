"""Async sharded saves: training blocks only to copy its local shards to host memory; DCP writes them on a
background thread; the commit waits for the next synchronisation point on the training thread.

Three phases per save. (1) Training thread, collective: wait for and commit the previous save, agree
that the non-sharded part encodes, let rank 0 create the staging directory, copy every local shard
into reusable host buffers (:class:`HostShards`). (2) Background thread, one per rank: ``dcp.save``
of those buffers into the staging directory, rank 0's non-sharded file, digests of this rank's files.
(3) Training thread, collective, at the next save, :meth:`AsyncShardedSaver.wait` or
:meth:`AsyncShardedSaver.close`: every rank reports its outcome; all raise the same
``ShardedSaveError`` if any failed, else rank 0 writes the marker and swaps the directory in (the
protocol of ``commit.py``). Until then the checkpoint is a hidden staging directory: never "last",
removed by ``clean_uncommitted`` if the run dies.

Deadlock-free by construction: the background thread runs collectives only on a gloo process group of
its own (DCP's planning gather/scatter, created once by the saver on every rank); every collective on
the training process group runs on the training thread at points that every rank reaches.

Why not ``torch.distributed.checkpoint.async_save`` (torch 2.13, state_dict_saver.py:221, which also
takes a ``process_group`` and runs ``save`` in a thread): its default stager allocates a fresh CPU copy
at every save (state_dict_saver.py:313), and its reusable one, ``BlockingAsyncStager(cache_staged_state_dict=True)``,
allocates pinned memory unconditionally (staging.py:316; fails without an accelerator) and hands back
0-dim DTensors uncopied (_state_dict_utils.py:447), so a later in-place update would leak into the file.
No Lightning here.
"""

from __future__ import annotations

import copy
import threading
import time
import warnings
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from lightning_resume import collective
from lightning_resume._compat.dcp import host_dtensor
from lightning_resume.errors import ShardedCheckpointWarning, ShardedSaveError, UnencodableValueError
from lightning_resume.format import write
from lightning_resume.sharded import commit as commits
from lightning_resume.sharded import marker
from lightning_resume.sharded.api import (
    checkpoint_path,
    commit_and_publish,
    discard_quietly,
    failure,
    rank_zero_files,
    recording_writer,
)
from lightning_resume.sharded.marker import META_FILE
from lightning_resume.storage import files as storage

Path = Tuple[Any, ...]


class HostShards:
    """Reusable host buffers for the local shards of a DCP state dict, one per tensor position.

    A buffer is allocated at the first save and reallocated only when that tensor's shape or dtype
    changes; it is pinned when the source is on CUDA (copied with ``non_blocking`` and one
    synchronisation). Non-tensor leaves are deep-copied. The caller must not stage again while a
    write of the previous staged state may still read the buffers.
    """

    def __init__(self) -> None:
        self._buffers: Dict[Path, torch.Tensor] = {}
        self._cuda = False

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def release(self) -> None:
        self._buffers.clear()

    @torch.no_grad()
    def stage(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """A copy of ``state`` whose tensors (DTensors: their local shards) live in this object's buffers."""
        self._cuda = False
        flat = {key: value.state_dict() if isinstance(value, Stateful) else value for key, value in state.items()}
        staged = self._copy(flat, ())
        if self._cuda:
            torch.cuda.synchronize()
        return staged

    def _copy(self, value: Any, path: Path) -> Any:
        if isinstance(value, DTensor):
            return host_dtensor(value, self._buffer(path, value.to_local()))
        if isinstance(value, torch.Tensor):
            return self._buffer(path, value)
        if isinstance(value, dict):
            return {key: self._copy(item, path + (key,)) for key, item in value.items()}
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            return type(value)(self._copy(item, path + (i,)) for i, item in enumerate(value))
        return copy.deepcopy(value)

    def _buffer(self, path: Path, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.is_cuda)
            self._buffers[path] = buffer
        self._cuda = self._cuda or tensor.is_cuda
        buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        return buffer


class _Write:
    """One rank's background part of one save; read its outcome only once :meth:`join` says it ended."""

    def __init__(
        self,
        directory: str,
        staging: str,
        step: int,
        staged: Dict[str, Any],
        meta: Optional[Tuple[str, Dict[str, torch.Tensor]]],
        group: Any,
    ) -> None:
        self.directory, self.staging, self.step = directory, staging, step
        self.problems: Dict[int, str] = {}
        self.files: Dict[str, marker.FileDigest] = {}
        self.seconds: Optional[float] = None
        self.committed = False
        self._args: Tuple[Any, ...] = (staged, meta, group)  # _write_local's arguments; emptied once written
        self._thread = threading.Thread(
            target=self._run, name=f"sharded-write {storage.basename(directory)}", daemon=True
        )  # a killed run leaves a hidden staging dir, nothing else

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: Optional[float] = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        started = time.monotonic()
        try:
            self.files = _write_local(self.staging, *self._args)
        except CheckpointException as err:  # DCP already gathered every rank's failure
            self.problems = {int(rank): collective.describe(exc) or "" for rank, (exc, _trace) in err.failures.items()}
        except BaseException as err:  # noqa: BLE001 - reported on the training thread at the commit
            self.problems = {collective.rank_and_world()[0]: collective.describe(err) or ""}
        self._args = ()  # the staged state is not needed any more
        self.seconds = time.monotonic() - started


def _write_local(
    staging: str, staged: Dict[str, Any], meta: Optional[Tuple[str, Dict[str, torch.Tensor]]], group: Any
) -> Dict[str, marker.FileDigest]:
    """The background part: DCP's collective write first (on ``group``, so no rank skips it), then rank 0's
    non-sharded file, then the digests of this rank's files."""
    writer = recording_writer(staging)
    dcp.save(staged, storage_writer=writer, process_group=group, no_dist=not collective.is_distributed())
    own = list(writer.written)
    if collective.rank_and_world()[0] == 0:
        if meta is not None:
            write.commit(storage.join(staging, META_FILE), *meta)
        own += rank_zero_files(meta is not None)
    return marker.digest_files(staging, own)


class ShardedSaveHandle:
    """The result of :func:`save_sharded_async`: ``done()`` is local and never blocks; ``wait()`` commits
    (collective) and raises the save's failure."""

    def __init__(self, saver: AsyncShardedSaver, write: _Write) -> None:
        self._saver = saver
        self._write = write
        self.directory = write.directory
        self.step = write.step

    def done(self) -> bool:
        """Whether this rank's background write has ended (the commit may still be to come)."""
        return not self._write.running()

    @property
    def committed(self) -> bool:
        return self._write.committed

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Collective: wait for every rank's write, then commit; ``False`` if a rank's write outlasted ``timeout``.

        ``True`` at once if this save was already settled (committed, or its failure already raised)."""
        return True if self._saver._pending is not self._write else self._saver.wait(timeout)


class AsyncShardedSaver:
    """At most one sharded save in flight per process, committed at the next synchronisation point.

    Every method except :meth:`write_in_flight` and the timings is collective: every rank calls it.
    """

    def __init__(self, timeout: Optional[timedelta] = None) -> None:
        self.timeout = timeout
        self.shards = HostShards()
        self._group: Any = None
        self._pending: Optional[_Write] = None
        self.last_wait_seconds: Optional[float] = None
        self.last_blocked_seconds: Optional[float] = None
        self.last_write_seconds: Optional[float] = None

    def save(
        self, state: Dict[str, Any], directory: str, step: int, meta: Optional[Dict[str, Any]] = None
    ) -> ShardedSaveHandle:
        """Commit the previous save (raising its failure), then stage ``state`` and start writing it. Collective."""
        started = time.monotonic()
        self.wait()
        staging_started = time.monotonic()
        self.last_wait_seconds = staging_started - started
        directory = checkpoint_path(directory)
        write = self._stage(state, directory, int(step), meta)
        write.start()
        self._pending = write
        self.last_blocked_seconds = time.monotonic() - staging_started
        return ShardedSaveHandle(self, write)

    def _stage(self, state: Dict[str, Any], directory: str, step: int, meta: Optional[Dict[str, Any]]) -> _Write:
        """Phase 1 on the training thread, with one collective: every rank encodes the non-sharded part
        and copies its shards, rank 0 also creates the staging directory; any rank's failure raises on
        every rank, and nothing is left behind."""
        group = self._background_group()
        rank = collective.rank_and_world()[0]
        local: Dict[str, Any] = {}

        def stage_locally() -> Optional[str]:
            local["meta"] = _snapshot_meta(meta)
            local["state"] = self.shards.stage(state)
            local["staging"] = commits.stage(directory) if rank == 0 else None
            return local["staging"]

        try:
            staging = collective.on_every_rank(stage_locally, failure(directory, "stage its shards"))[0]
        except BaseException:
            if local.get("staging"):
                discard_quietly(local["staging"])
            raise
        assert staging is not None  # rank 0's value: the staging directory it created
        return _Write(directory, staging, step, local["state"], local["meta"] if rank == 0 else None, group)

    def _background_group(self) -> Any:
        """The background thread's own gloo group (created once, collectively, on the training thread)."""
        if not collective.is_distributed():
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)
        return self._group

    def write_in_flight(self, path: Optional[str] = None) -> bool:
        """Without ``path``: this rank's background write is running. With ``path``: it is not committed yet.

        (A finished write waits for the next synchronisation point to be committed; that wait is not
        "in flight" for a schedule, which would otherwise wait for a commit only its next save performs.)
        """
        write = self._pending
        if write is None:
            return False
        if path is None:
            return write.running()
        return checkpoint_path(str(path)) == write.directory

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait for every rank's write and commit it; raise its failure. ``False`` (nothing committed) on timeout."""
        return not self._settle(timeout)

    def _settle(self, timeout: Optional[float]) -> List[int]:
        """Phase 3; returns the ranks whose write is still running (then the save stays pending)."""
        write = self._pending
        if write is None:
            return []
        finished = write.join(timeout)
        mine = (True, write.problems, write.files, write.seconds) if finished else (False, {}, {}, None)
        outcomes = collective.gather(mine)
        running = [rank for rank, outcome in enumerate(outcomes) if not outcome[0]]
        if running:
            return running
        self._pending = None
        problems = {rank: text for _, part, _, _ in outcomes for rank, text in part.items()}
        if problems:
            self._discard(write)
            raise ShardedSaveError(write.directory, "write its shards in the background", problems)
        files = {name: digest for _, _, part, _ in outcomes for name, digest in part.items()}
        record = marker.CommitRecord(write.staging, write.step, len(outcomes), files)
        try:
            collective.on_rank_zero(
                lambda: commit_and_publish(record, write.directory), failure(write.directory, "commit")
            )
        except BaseException:
            self._discard(write)
            raise
        write.committed = True
        # every write finished, so each one timed itself (only an unfinished one sends None)
        self.last_write_seconds = max(seconds for _, _, _, seconds in outcomes if seconds is not None)
        return []

    @staticmethod
    def _discard(write: _Write) -> None:
        if collective.rank_and_world()[0] == 0:
            discard_quietly(write.staging)

    def close(self, timeout: Optional[float] = None) -> None:
        """Collective end of a run: commit the pending save within ``timeout``; raise naming its directory if not."""
        write = self._pending
        running = self._settle(timeout)
        if running:
            assert write is not None  # _settle reports running ranks only for a pending write
            self._pending = None  # left as a hidden staging directory: never "last", cleaned up later
            raise ShardedSaveError(
                write.directory,
                f"finish its background write within {timeout} s",
                {rank: "still writing" for rank in running},
            )
        self.shards.release()

    def abandon(self, timeout: Optional[float] = None) -> None:
        """Not collective (other ranks may be gone): after an exception, give the write ``timeout`` to end,
        then leave it uncommitted with a warning. The previous committed checkpoint stays the newest."""
        write, self._pending = self._pending, None
        if write is None:
            return
        write.join(timeout)
        warnings.warn(
            f"sharded checkpoint {write.directory} was not committed (the run ended by an exception while "
            "it was written in the background); the previous committed checkpoint is the newest",
            ShardedCheckpointWarning,
            stacklevel=2,
        )


def _snapshot_meta(meta: Optional[Dict[str, Any]]) -> Optional[Tuple[str, Dict[str, torch.Tensor]]]:
    """The non-sharded part, encoded now (values frozen as JSON text, tensors cloned) for the background write."""
    if meta is None:
        return None
    if not isinstance(meta, dict):
        raise UnencodableValueError("<root>", type(meta).__qualname__, "the non-sharded part must be a dict")
    tree_json, tensors = write.encode_tree(meta)
    return tree_json, {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}


_DEFAULT: Optional[AsyncShardedSaver] = None


def save_sharded_async(
    state: Dict[str, Any],
    directory: str,
    step: int,
    meta: Optional[Dict[str, Any]] = None,
    saver: Optional[AsyncShardedSaver] = None,
) -> ShardedSaveHandle:
    """:func:`save_sharded` whose write runs in the background; returns once the local shards are copied. Collective.

    It first commits the save before it (one in flight per ``saver``; the default is one saver per
    process). The new ``directory`` is committed at the next save through the same saver, at
    ``handle.wait()`` or at ``saver.close()``; until then an existing ``directory`` is untouched.
    A failure of the write raises ``ShardedSaveError`` on every rank at that point.
    """
    global _DEFAULT
    if saver is None:
        _DEFAULT = _DEFAULT or AsyncShardedSaver()
        saver = _DEFAULT
    return saver.save(state, directory, step, meta)
