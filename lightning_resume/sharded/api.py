"""Sharded save and load over ``torch.distributed.checkpoint``, with the commit protocol of ``commit.py``.

Every rank writes its own shards in parallel (DCP's ``FileSystemWriter``) into a staging directory
that rank 0 created and named, digests the files it wrote, and rank 0 commits the marker and swaps
the directory in once all have finished. Everything that can fail on one rank alone (encoding the
non-sharded part, rank 0's file operations) is followed by an exchange of outcomes, so a failure
raises the same ``ShardedSaveError`` on every rank instead of leaving the others at a barrier until
the process-group timeout. Loading verifies the
marker and digests first, then reads with the pickle-restricted reader and planner of
``safe_pickle.py``; DCP reshards, so the world size at load may differ from the one at save. Works
with or without an initialised process group (one process: ``no_dist``). No Lightning here.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

from lightning_resume import ranks
from lightning_resume.errors import CheckpointCorruptError, LightningResumeError
from lightning_resume.io.files import load_file, save_file
from lightning_resume.io.format import UnencodableValueError, encode
from lightning_resume.sharded import commit as commits
from lightning_resume.sharded.safe_pickle import SafeFileSystemReader, SafeLoadPlanner, load_metadata

DCP_METADATA = ".metadata"
META_FILE = "meta.safetensors"
"""The non-sharded part (loop counters, callback state, RNG...): one file of ``lightning_resume.io``'s format."""


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


def _broadcast(obj: Any) -> Any:
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class ShardedSaveError(LightningResumeError):
    """A sharded save failed on some rank; every rank raises this same error (none is left waiting)."""

    def __init__(self, directory: str, step: str, problems: Mapping[int, str]) -> None:
        self.directory = directory
        self.problems = dict(problems)
        ranks_by_problem: Dict[str, List[int]] = {}
        for rank, problem in sorted(self.problems.items()):
            ranks_by_problem.setdefault(problem, []).append(rank)
        where = "; ".join(f"{'ranks' if len(r) > 1 else 'rank'} {', '.join(map(str, r))}: {problem}"
                          for problem, r in ranks_by_problem.items())
        super().__init__(f"sharded save of {directory} failed to {step} ({where}); the previous checkpoint there, "
                         "if any, is untouched")


def _check_meta(meta: Optional[Dict[str, Any]]) -> None:
    """Encode ``meta`` as ``save_file`` will (on every rank), so a bad value fails before any collective."""
    if meta is None:
        return
    if not isinstance(meta, dict):
        raise UnencodableValueError("<root>", type(meta).__qualname__, "the non-sharded part must be a dict")
    encode(meta)


def _on_every_rank(directory: str, step: str, fn: Callable[[], Any]) -> List[Any]:
    """Run ``fn`` on every rank and gather the results; if any rank failed, every rank raises."""
    value, error = None, None
    try:
        value = fn()
    except Exception as err:  # handed to every rank below; re-raised chained on this one
        error = err
    outcomes = ranks.gather((_describe(error), value))
    problems = {rank: problem for rank, (problem, _) in enumerate(outcomes) if problem is not None}
    if problems:
        raise ShardedSaveError(directory, step, problems) from error
    return [v for _, v in outcomes]


def _on_rank_zero(directory: str, step: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 only and broadcast its result, or its error to be raised on every rank."""
    value, error = None, None
    if _rank_world()[0] == 0:
        try:
            value = fn()
        except Exception as err:  # broadcast below; re-raised chained on rank 0
            error = err
    problem, value = _broadcast((_describe(error), value))
    if problem is not None:
        raise ShardedSaveError(directory, step, {0: problem}) from error
    return value


def _describe(error: Optional[BaseException]) -> Optional[str]:
    return None if error is None else f"{type(error).__name__}: {error}"


def _stage(directory: str, meta: Optional[Dict[str, Any]]) -> str:
    """Rank 0: the staging directory, holding the non-sharded part already (removed again on failure)."""
    staging = commits.stage(directory)
    try:
        if meta is not None:
            save_file(meta, os.path.join(staging, META_FILE))
    except BaseException:
        commits.discard(staging)
        raise
    return staging


def save_sharded(state: Dict[str, Any], directory: str, step: int, meta: Optional[Dict[str, Any]] = None) -> str:
    """Every rank writes its shards of ``state``; rank 0 commits and swaps them in as ``directory``. Collective.

    ``state`` is a DCP state dict (DTensors, tensors, ``Stateful`` objects, plain values). ``meta``
    is an optional dict, identical on every rank, that rank 0 writes as one safetensors file with
    typed JSON (``lightning_resume.io``'s format). Until the swap, an existing ``directory`` is
    untouched. When this returns on any rank, ``directory`` is committed; when it raises (the same
    ``ShardedSaveError`` on every rank), the previous ``directory`` is still there.
    """
    directory = os.path.abspath(directory)
    rank, world = _rank_world()
    _on_every_rank(directory, "encode the non-sharded state", lambda: _check_meta(meta))
    staging = _on_rank_zero(directory, "create its staging directory", lambda: _stage(directory, meta))
    try:
        writer = _write_shards(state, staging, directory)
        own = writer.written + (_rank_zero_files(meta is not None) if rank == 0 else [])
        parts = _on_every_rank(directory, "digest its files", lambda: commits.digest_files(staging, own))
        files = {name: digest for part in parts for name, digest in part.items()}
        record = commits.CommitRecord(staging, int(step), world, files)
        _on_rank_zero(directory, "commit", lambda: _commit_and_publish(record, directory))
    except BaseException:
        if rank == 0:
            _discard_quietly(staging)
        raise
    return directory


def _rank_zero_files(with_meta: bool) -> List[str]:
    """What rank 0 writes besides its shards: DCP's ``.metadata`` and our meta file."""
    return [DCP_METADATA, META_FILE] if with_meta else [DCP_METADATA]


def _write_shards(state: Dict[str, Any], staging: str, directory: str) -> _RecordingWriter:
    """DCP's collective write; DCP itself gathers every rank's exception and raises on all of them."""
    writer = _RecordingWriter(staging)
    try:
        dcp.save(state, storage_writer=writer, no_dist=not _distributed())
    except CheckpointException as err:
        problems = {int(rank): _describe(exc) for rank, (exc, _trace) in err.failures.items()}
        raise ShardedSaveError(directory, "write its shards", problems) from err
    return writer


def _commit_and_publish(record: commits.CommitRecord, directory: str) -> None:
    commits.commit(record)
    commits.publish(record.path, directory)


def _discard_quietly(staging: str) -> None:
    try:
        commits.discard(staging)
    except OSError:
        pass  # a leftover staging directory is hidden and removed by clean_uncommitted


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


def load_meta(directory: str) -> Optional[Dict[str, Any]]:
    """The ``meta`` dict given to :func:`save_sharded` (``None`` if it had none), checksums verified.

    Verify the directory first (:func:`verify_sharded`); this reads only the marker and the meta file.
    """
    if META_FILE not in commits.read_marker(directory).files:
        return None
    return load_file(os.path.join(directory, META_FILE)).checkpoint


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
