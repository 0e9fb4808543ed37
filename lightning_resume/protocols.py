"""Structural interfaces between the parts, checked with ``isinstance`` (``runtime_checkable``).

They let a hook use a mechanism without importing it: ``RetentionCheckpoint`` verifies files with
whatever ``CheckpointIO`` the trainer has, if that IO can verify, and lets it resolve "last" if it can; ``ExactResume`` triggers saves
through whatever checkpoint callback can take a snapshot on demand. The memory tier reuses a durable save's
staging through :class:`StagingLender`; a restore reads weights into the live module through
:class:`InPlaceLoading`. :func:`checkpoint_io_as` finds the trainer's IO that has a given protocol.
"""

from __future__ import annotations

from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    runtime_checkable,
)

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl
    import torch


@runtime_checkable
class VerifyingCheckpointIO(Protocol):
    """A ``CheckpointIO`` that can check a file without loading it into a model."""

    def verify_checkpoint(self, path: str) -> None:
        """Return if ``path`` verifies; raise ``CheckpointCorruptError`` naming what is wrong otherwise."""


@runtime_checkable
class ResolvingCheckpointIO(Protocol):
    """A ``CheckpointIO`` that resolves "last" itself, so that a resume reads the checkpoint once.

    It checks each candidate only as far as its own load will not check it again (a load that hashes
    every byte needs only the header checked here), and if the load of the one it chose fails, it falls
    back along the other candidates, newest first, before any state is applied.
    """

    def resolve_newest(
        self, paths: Sequence[str], skipped: Callable[[str], None], weights_only: bool = True
    ) -> Optional[str]:
        """The newest of ``paths`` (by training progress) to resume from; each one passed over told to ``skipped``.
        ``weights_only``: the user's ``fit(..., weights_only=...)`` (``False``: a ``torch.save`` candidate that
        needs pickled objects may be unpickled in full, as its load will be)."""

    def loaded_path(self, path: str) -> str:
        """The file a load of ``path`` actually read: ``path``, or the candidate it fell back to."""


@runtime_checkable
class LastResolver(Protocol):
    """A callback that decides what ``ckpt_path="last"`` means for every checkpoint callback of the trainer
    (``ExactResume``; ``RetentionCheckpoint`` with a retention rule). Lightning asks each ``ModelCheckpoint``;
    the first resolver among the trainer's callbacks answers for all of them."""

    @property
    def resolves_last(self) -> bool:
        """Whether this callback resolves "last" (else Lightning's own rule, ``last*.ckpt`` by time, applies)."""

    def resolve_last(self, trainer: pl.Trainer) -> set[str]:
        """The checkpoint ``ckpt_path="last"`` resumes from, as a set of at most one path."""


@runtime_checkable
class MemoryFirst(Protocol):
    """A callback that may resume ``fit(ckpt_path="last")`` from a memory tier (``ExactResume`` with
    ``memory_tier``): "last" resolution then reads each durable candidate only as far as its header, and verifies
    the durable checkpoint in full only if the memory tier does not supply the resume (``retention.last``)."""

    def resumes_from_memory_first(self, trainer: pl.Trainer) -> bool:
        """Whether this ``fit`` asks the memory tier before any durable checkpoint is read beyond its header."""


@runtime_checkable
class SnapshotTarget(Protocol):
    """A checkpoint callback that writes a snapshot when asked (used by ``ExactResume``'s schedule).

    ``accepts_snapshots`` is ``False`` while it should not be asked (e.g. a ``RetentionCheckpoint``
    with no retention rule, which must behave exactly like ``ModelCheckpoint``).
    """

    @property
    def accepts_snapshots(self) -> bool:
        """Whether scheduled snapshots should go through this callback now."""

    def save_snapshot(self, trainer: pl.Trainer, reason: str) -> str:
        """Write a full checkpoint of ``trainer`` now, count it as a rolling checkpoint, return its path."""


@runtime_checkable
class AsyncCheckpointWriter(Protocol):
    """A ``CheckpointIO`` whose saves may return before the file is durable (written on a worker).

    ``ExactResume`` records only the snapshot part as blocking time and starts no save while a write
    is in flight; ``RetentionCheckpoint`` keeps such a file in flight until it is durable.
    """

    last_blocked_seconds: Optional[float]
    last_write_seconds: Optional[float]
    flush_timeout: float

    def write_in_flight(self, path: Optional[str] = None) -> bool:
        """Whether a write (of ``path``, if given) is queued or running."""

    def wait(self, path: Optional[str] = None, timeout: Optional[float] = None) -> bool:
        """Block until ``path`` (or every pending write) is durable; raise its failure; ``False`` on timeout."""


@runtime_checkable
class StagingCheckpointIO(Protocol):
    """A ``CheckpointIO`` that can prepare its host staging memory ahead of the first save."""

    def reserve(self, nbytes: int, pinned: bool = False) -> None:
        """Allocate and touch staging memory for a checkpoint of about ``nbytes``, in the background."""


@runtime_checkable
class DigestingCheckpointIO(Protocol):
    """A ``CheckpointIO`` whose files record every tensor's digest, checked when the file is loaded: hashing the
    state again at each save proves nothing more (``ExactResume``'s fingerprint then takes the file's)."""

    records_digests: bool


class Loan(Protocol):
    """What a :class:`StagingLender` lends (``staging.lending.Lending``)."""

    @property
    def overlapped(self) -> bool:
        """Whether the lender's saves copy the optimizer-stepped state while the next step runs."""

    @property
    def newest(self) -> Callable[[], Any]:
        """Returns the lender's newest ``staging.lending.Offer`` (``None`` before its first save)."""


@runtime_checkable
class StagingLender(Protocol):
    """A ``CheckpointIO`` whose async saves can lend their staged tensors to a second snapshot of the same state
    at the same point (``staging.lending``): ``ExactResume``'s memory tier, at the step of a durable save."""

    def lend_staging(self) -> Optional[Loan]:
        """Keep an offer of each save's staged tensors from now on, and return the handle that reads the newest
        one; ``None`` when this IO stages nothing (its saves write from the tensors themselves)."""


InPlaceTarget = Tuple["torch.nn.Module", Dict[Tuple[str, ...], "torch.Tensor"]]
"""A module offered to a load, and its tensors by their place in the checkpoint's tree (``format.in_place``)."""


@runtime_checkable
class InPlaceLoading(Protocol):
    """A ``CheckpointIO`` that can read a checkpoint's weights straight into the module the run already built."""

    def load_into(self, module: Optional[torch.nn.Module]) -> None:
        """Offer ``module``'s tensors to the next load, or withdraw them (``None``)."""

    def loaded_in_place(self) -> Dict[str, Tuple[str, str]]:
        """The weights the latest load read in place: state-dict name -> the file's ``(algorithm, digest)``."""

    def in_place_target(self) -> Optional[InPlaceTarget]:
        """The module offered to the next load and its tensors by their place in a checkpoint's tree, when this IO
        would read that load in place; ``None`` otherwise (nothing offered, or this IO reads into new memory)."""


@runtime_checkable
class LineageKeeping(Protocol):
    """A ``CheckpointIO`` whose saves continue a lineage between runs (``SafetensorsCheckpointIO(dedupe=True)``)."""

    def continue_lineage(self, path: str) -> None:
        """Continue the lineage of the durable checkpoint ``path``: the resume read its state elsewhere."""


@runtime_checkable
class LocalShardSnapshots(Protocol):
    """A strategy whose ranks hold shards (``io.sharded_strategy.ShardedModelParallelStrategy``) that the memory
    tier can snapshot one file per rank, as its local shards (``sharded.local``), and restore on the same mesh."""

    def memory_snapshot(self, checkpoint: Dict[str, Any]) -> Dict[str, Any]:
        """``checkpoint`` (Lightning's, built on this rank) with its sharded tensors as this rank's local shards."""

    def check_local(self, checkpoint: Dict[str, Any]) -> list[str]:
        """What keeps ``checkpoint`` (a :meth:`memory_snapshot`, loaded) from restoring this rank's state now, one
        line per problem (another mesh, dtype or model); empty when it fits."""

    def restore_local(self, checkpoint: Dict[str, Any]) -> Dict[str, Any]:
        """Restore the model and optimizers from ``checkpoint``'s local shards (after :meth:`check_local` found
        nothing); the rest of the checkpoint, for Lightning to restore as it restores a durable one's."""


def checkpoint_io_as(trainer: Any, protocol: type) -> Any:
    """The trainer's ``CheckpointIO`` if it has ``protocol``, also inside a wrapping IO (Lightning's
    ``AsyncCheckpointIO`` keeps the IO it wraps as ``checkpoint_io``); ``None`` otherwise."""
    io = getattr(getattr(trainer, "strategy", None), "checkpoint_io", None)
    while io is not None and not isinstance(io, protocol):
        io = getattr(io, "checkpoint_io", None)
    return io


def offer_module(trainer: Any, module: Optional[torch.nn.Module]) -> None:
    """Hand ``module`` to the trainer's :class:`InPlaceLoading` IO for the load that restores it, or withdraw it
    (``None``). Nothing for another IO, or for a strategy that restores after its own setup (FSDP, DeepSpeed:
    the module is wrapped and sharded by then)."""
    io: Optional[InPlaceLoading] = checkpoint_io_as(trainer, InPlaceLoading)
    if io is not None:
        later = getattr(getattr(trainer, "strategy", None), "restore_checkpoint_after_setup", False)
        io.load_into(None if later else module)


def in_place_target(trainer: Any) -> Optional[InPlaceTarget]:
    """What the trainer's :class:`InPlaceLoading` IO would read the restore's checkpoint into (the module
    :func:`offer_module` handed it, and that module's tensors by tree path), for a restore that reads its
    checkpoint elsewhere (the memory tier's snapshot); ``None`` for another IO or when nothing is offered."""
    io: Optional[InPlaceLoading] = checkpoint_io_as(trainer, InPlaceLoading)
    return None if io is None else io.in_place_target()


def continue_lineage(trainer: Any, path: str) -> None:
    """Tell the trainer's :class:`LineageKeeping` IO, if it has one, that the run resumed the state of ``path`` from
    elsewhere (the memory tier); nothing for another IO."""
    io: Optional[LineageKeeping] = checkpoint_io_as(trainer, LineageKeeping)
    if io is not None:
        io.continue_lineage(path)


def loaded_in_place(trainer: Any) -> Dict[str, Tuple[str, str]]:
    """The weights the trainer's latest load read in place (empty for an IO without :class:`InPlaceLoading`)."""
    io: Optional[InPlaceLoading] = checkpoint_io_as(trainer, InPlaceLoading)
    return {} if io is None else io.loaded_in_place()
