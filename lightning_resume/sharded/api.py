"""Sharded save and load over ``torch.distributed.checkpoint``, with the commit protocol of ``commit.py``.

Every rank writes its own shards in parallel (DCP's ``FileSystemWriter``) into a staging directory
that rank 0 created and named, digests the files it wrote, and rank 0 commits the marker and swaps
the directory in once all have finished (on an object store: DCP's fsspec writer into a versioned
sub-prefix, and the marker's one PUT is the commit; ``commit.py``). Everything that can fail on one rank alone (encoding the
non-sharded part, rank 0's file operations) is followed by an exchange of outcomes, so a failure
raises the same ``ShardedSaveError`` on every rank instead of leaving the others at a barrier until
the process-group timeout. Loading verifies the
marker and digests first, then reads with the pickle-restricted reader and planner of
``safe_pickle.py``; DCP reshards, so the world size at load may differ from the one at save. Works
with or without an initialised process group (one process: ``no_dist``). Every path is a local directory
or an fsspec URL, through ``storage`` (a URL keeps its scheme). No Lightning here.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from typing_extensions import override

from lightning_resume import collective
from lightning_resume._compat import dcp as dcp_compat
from lightning_resume.errors import (
    CheckpointCorruptError,
    LightningResumeError,
    ShardedSaveError,
    UnencodableValueError,
    UnsafeCheckpointError,
)
from lightning_resume.format.codec import encode
from lightning_resume.format.read import load_file
from lightning_resume.format.write import save_file
from lightning_resume.sharded import commit as commits
from lightning_resume.sharded import marker
from lightning_resume.sharded.marker import DCP_METADATA, META_FILE
from lightning_resume.sharded.safe_pickle import SafeLoadPlanner, safe_reader
from lightning_resume.sharded.verify import verify_directory
from lightning_resume.storage import files as storage


def _written(future: Any) -> List[str]:
    """The files a DCP ``write_data`` future wrote, sorted (it has completed once this returns)."""
    return sorted({result.storage_data.relative_path for result in future.wait()})


class RecordingWriter(FileSystemWriter):
    """Remembers which files this rank wrote, so it can digest exactly those."""

    def __init__(self, path: str) -> None:
        super().__init__(path, sync_files=True)
        self.written: List[str] = []

    @override
    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        self.written = _written(future)
        return future


class RecordingFsspecWriter(dcp_compat.FsspecWriter):
    """:class:`RecordingWriter` for a URL: DCP's fsspec writer (an object is durable once its upload ends:
    no fsync, whose fallback would be ``os.sync`` of the whole machine per file)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, sync_files=False)
        self.written: List[str] = []

    @override
    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        self.written = _written(future)
        return future


def recording_writer(staging: str) -> Union[RecordingWriter, RecordingFsspecWriter]:
    """The DCP writer for ``staging``: the file-system one locally, the fsspec one for a URL."""
    if storage.is_local(staging):
        return RecordingWriter(storage.local_path(staging))
    return RecordingFsspecWriter(staging)


def checkpoint_path(path: str) -> str:
    """``path`` as every rank names it: a local path made absolute, a URL as given (scheme kept)."""
    path = str(path)
    return path.rstrip("/") if "://" in path and storage.is_remote(path) else os.path.abspath(storage.local_path(path))


class _SafeFullLoadPlanner(SafeLoadPlanner, dcp_compat.EmptyStateDictLoadPlanner):
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


def _check_meta(meta: Optional[Dict[str, Any]]) -> None:
    """Encode ``meta`` as ``save_file`` will (on every rank), so a bad value fails before any collective."""
    if meta is None:
        return
    if not isinstance(meta, dict):
        raise UnencodableValueError("<root>", type(meta).__qualname__, "the non-sharded part must be a dict")
    encode(meta)


def failure(directory: str, step: str) -> collective.Failure:
    return lambda problems: ShardedSaveError(directory, step, problems)


def _stage(directory: str, meta: Optional[Dict[str, Any]]) -> str:
    """Rank 0: the staging directory, holding the non-sharded part already (removed again on failure)."""
    staging = commits.stage(directory)
    try:
        if meta is not None:
            save_file(meta, storage.join(staging, META_FILE))
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
    directory = checkpoint_path(directory)
    rank, world = collective.rank_and_world()
    collective.on_every_rank(lambda: _check_meta(meta), failure(directory, "encode the non-sharded state"))
    staging = collective.on_rank_zero(
        lambda: _stage(directory, meta), failure(directory, "create its staging directory")
    )
    try:
        writer = _write_shards(state, staging, directory)
        own = writer.written + (rank_zero_files(meta is not None) if rank == 0 else [])
        parts = collective.on_every_rank(
            lambda: marker.digest_files(staging, own), failure(directory, "digest its files")
        )
        files = {name: digest for part in parts for name, digest in part.items()}
        record = marker.CommitRecord(staging, int(step), world, files)
        collective.on_rank_zero(lambda: commit_and_publish(record, directory), failure(directory, "commit"))
    except BaseException:
        if rank == 0:
            discard_quietly(staging)
        raise
    return directory


def rank_zero_files(with_meta: bool) -> List[str]:
    """What rank 0 writes besides its shards: DCP's ``.metadata`` and our meta file."""
    return [DCP_METADATA, META_FILE] if with_meta else [DCP_METADATA]


def _write_shards(state: Dict[str, Any], staging: str, directory: str) -> Union[RecordingWriter, RecordingFsspecWriter]:
    """DCP's collective write; DCP itself gathers every rank's exception and raises on all of them."""
    writer = recording_writer(staging)
    try:
        dcp.save(state, storage_writer=writer, no_dist=not collective.is_distributed())
    except CheckpointException as err:
        problems = {int(rank): collective.describe(exc) or "" for rank, (exc, _trace) in err.failures.items()}
        raise ShardedSaveError(directory, "write its shards", problems) from err
    return writer


def commit_and_publish(record: marker.CommitRecord, directory: str) -> None:
    replaced = commits.current_version(directory)  # an object store's version the commit replaces
    commits.commit(record)
    commits.publish(record.path, directory, replaced)


def discard_quietly(staging: str) -> None:
    with contextlib.suppress(OSError):  # a leftover staging directory is hidden and removed by clean_uncommitted
        commits.discard(staging)


def verify_sharded(directory: str, digests: bool = True) -> marker.CommitRecord:
    """The directory is committed and every file it lists is intact; ``CheckpointCorruptError`` otherwise.

    The same check as ``lightning-resume verify`` and "last" resolution (``sharded.verify.verify_directory``).
    """
    return verify_directory(directory, digests)


def _verified_everywhere(directory: str, digests: bool) -> marker.CommitRecord:
    """Rank 0 verifies (one read of every file), every rank gets the verdict."""
    problem: Optional[str] = None
    unsafe = False
    record = None
    if collective.rank_and_world()[0] == 0:
        try:
            record = verify_sharded(directory, digests)
        except (LightningResumeError, OSError) as err:  # any failure here must reach every rank
            problem, unsafe = str(err), isinstance(err, UnsafeCheckpointError)
    problem, unsafe, record = collective.broadcast((problem, unsafe, record))
    if problem is not None:
        if unsafe:
            raise UnsafeCheckpointError(directory, problem)
        raise CheckpointCorruptError(directory, f"refusing to load: {problem}")
    assert record is not None  # rank 0 sent either a problem or the record it verified
    return record


def load_sharded(state_template: Dict[str, Any], directory: str, digests: bool = True) -> marker.CommitRecord:
    """Load ``directory`` in place into ``state_template`` (resharding to its layout). Collective.

    The template's tensors/DTensors give the layout wanted now; the world size may differ from the
    one that saved. Returns the commit record (step, world size at save).
    """
    directory = checkpoint_path(directory)
    record = _verified_everywhere(directory, digests)
    with _domain_errors():  # only the files of the version this record names, whatever is saved meanwhile
        dcp.load(
            state_template,
            storage_reader=safe_reader(record.location, record.files),
            planner=SafeLoadPlanner(),
            no_dist=not collective.is_distributed(),
        )
    return record


def load_meta(directory: str, record: Optional[marker.CommitRecord] = None) -> Optional[Dict[str, Any]]:
    """The ``meta`` dict given to :func:`save_sharded` (``None`` if it had none), checksums verified.

    Verify the directory first (:func:`verify_sharded`); this reads only the marker and the meta file.
    ``record``: the one :func:`load_sharded` returned, so that both read the same save (on an object store
    a re-save under the same name may commit in between).
    """
    record = marker.read_marker(checkpoint_path(directory)) if record is None else record
    if META_FILE not in record.files:
        return None
    return load_file(storage.join(record.location, META_FILE)).checkpoint


def load_full(directory: str, digests: bool = True) -> Dict[str, Any]:
    """The whole state of ``directory`` as plain tensors and values, in this one process (no template)."""
    record = verify_sharded(checkpoint_path(directory), digests)  # every storage reference of the metadata too
    state: Dict[str, Any] = {}
    with _domain_errors():
        reader = safe_reader(record.location, record.files)
        dcp_compat.load_without_template(state, reader, _SafeFullLoadPlanner())
    return state


def clean_uncommitted(root: str, keep: Mapping[str, Any] | Sequence[str] = ()) -> List[str]:
    """Remove stale uncommitted checkpoint directories we left under ``root`` (call before the first save)."""
    return commits.clean_uncommitted(root, list(keep))
