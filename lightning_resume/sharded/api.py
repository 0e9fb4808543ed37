"""Sharded save and load over ``torch.distributed.checkpoint``, with the commit protocol of ``commit.py``.

Every rank writes its own shards in parallel (DCP's ``FileSystemWriter``), digests the files it
wrote, and rank 0 writes the ``COMMITTED`` marker once all have finished. Loading verifies the
marker and digests first, then reads with the pickle-restricted reader and planner of
``safe_pickle.py``; DCP reshards, so the world size at load may differ from the one at save. Works
with or without an initialised process group (one process: ``no_dist``). No Lightning here.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, Iterator, List, Mapping, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

from lightning_resume.errors import CheckpointCorruptError, LightningResumeError
from lightning_resume.sharded import commit as commits
from lightning_resume.sharded.meta import read_meta, write_meta
from lightning_resume.sharded.safe_pickle import SafeFileSystemReader, SafeLoadPlanner, load_metadata

DCP_METADATA = ".metadata"


class _RecordingWriter(FileSystemWriter):
    """Remembers which files this rank wrote, so it can digest exactly those."""

    def __init__(self, path: str) -> None:
        super().__init__(path, sync_files=True)
        self.written: List[str] = []

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        self.written = sorted({result.storage_data.relative_path for result in future.wait()})
        return future


class _SafeFullLoadPlanner(SafeLoadPlanner, _EmptyStateDictLoadPlanner):
    """Rebuilds the whole state from the metadata (DCP's private empty-state planner), pickle-restricted."""


@contextlib.contextmanager
def _domain_errors() -> Iterator[None]:
    """DCP wraps every rank's exception in a ``CheckpointException``; surface ours unwrapped."""
    try:
        yield
    except CheckpointException as err:
        for exc, _trace in err.failures.values():
            if isinstance(exc, LightningResumeError):
                raise exc from err
        raise


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _gather(obj: Any) -> List[Any]:
    if not _distributed():
        return [obj]
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj: Any) -> Any:
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_sharded(state: Dict[str, Any], directory: str, step: int, meta: Optional[Any] = None) -> str:
    """Every rank writes its shards of ``state`` into ``directory``; rank 0 commits it last. Collective.

    ``state`` is a DCP state dict (DTensors, tensors, ``Stateful`` objects, plain values). ``meta``
    is an optional tree of plain values and tensors, identical on every rank, written pickle-free by
    rank 0. When this returns on any rank, ``directory`` is committed.
    """
    directory = os.path.abspath(directory)
    rank, world = _rank_world()
    extra: List[str] = []
    if rank == 0:
        commits.begin(directory)
        if meta is not None:
            extra = list(write_meta(meta, directory))
    _barrier()
    writer = _RecordingWriter(directory)
    dcp.save(state, storage_writer=writer, no_dist=not _distributed())
    mine = commits.digest_files(directory, writer.written + (extra + [DCP_METADATA] if rank == 0 else []))
    files: Dict[str, commits.FileDigest] = {}
    for part in _gather(mine):
        files.update(part)
    if rank == 0:
        commits.commit(commits.CommitRecord(directory, int(step), world, files))
    _barrier()
    return directory


def verify_sharded(directory: str, digests: bool = True) -> commits.CommitRecord:
    """The directory is committed and every file it lists is intact; ``CheckpointCorruptError`` otherwise."""
    record = commits.verify_committed(directory, digests)
    if DCP_METADATA not in record.files:
        raise CheckpointCorruptError(directory, f"commit marker does not list {DCP_METADATA}")
    return record


def _verified_everywhere(directory: str, digests: bool) -> commits.CommitRecord:
    """Rank 0 verifies (one read of every file), every rank gets the verdict."""
    problem: Optional[str] = None
    record = None
    if _rank_world()[0] == 0:
        try:
            record = verify_sharded(directory, digests)
        except CheckpointCorruptError as err:
            problem = str(err)
    problem, record = _broadcast((problem, record))
    if problem is not None:
        raise CheckpointCorruptError(directory, f"refusing to load: {problem}")
    return record


def load_sharded(state_template: Dict[str, Any], directory: str, digests: bool = True) -> commits.CommitRecord:
    """Load ``directory`` in place into ``state_template`` (resharding to its layout). Collective.

    The template's tensors/DTensors give the layout wanted now; the world size may differ from the
    one that saved. Returns the commit record (step, world size at save).
    """
    directory = os.path.abspath(directory)
    record = _verified_everywhere(directory, digests)
    load_metadata(os.path.join(directory, DCP_METADATA))  # refuse a hostile file here, with its own error
    with _domain_errors():
        dcp.load(state_template, storage_reader=SafeFileSystemReader(directory), planner=SafeLoadPlanner(),
                 no_dist=not _distributed())
    return record


def load_meta(directory: str) -> Any:
    """The pickle-free ``meta`` tree given to :func:`save_sharded` (verify the directory first)."""
    return read_meta(directory)


def load_full(directory: str, digests: bool = True) -> Dict[str, Any]:
    """The whole state of ``directory`` as plain tensors and values, in this one process (no template)."""
    directory = os.path.abspath(directory)
    verify_sharded(directory, digests)
    # dcp.load copies back only the keys the template already has; the empty-template path is DCP's
    # private _load_state_dict (torch/distributed/checkpoint/state_dict_loader.py:203), as its own
    # dcp_to_torch_save does (format_utils.py:224).
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    load_metadata(os.path.join(directory, DCP_METADATA))
    state: Dict[str, Any] = {}
    with _domain_errors():
        _load_state_dict(state, storage_reader=SafeFileSystemReader(directory), planner=_SafeFullLoadPlanner(),
                         no_dist=True)
    return state


def newest_committed(root: str, digests: bool = True) -> Optional[str]:
    """The newest committed, verifying checkpoint directory directly under ``root`` (``None`` if none)."""
    return commits.newest_committed(root, digests)


def clean_uncommitted(root: str, keep: Mapping[str, Any] | List[str] = ()) -> List[str]:
    """Remove stale uncommitted checkpoint directories we left under ``root`` (call before the first save)."""
    return commits.clean_uncommitted(root, list(keep))
