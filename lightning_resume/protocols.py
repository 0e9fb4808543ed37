"""Structural interfaces between the parts, checked with ``isinstance`` (``runtime_checkable``).

They let a hook use a mechanism without importing it: ``RetentionCheckpoint`` verifies files with
whatever ``CheckpointIO`` the trainer has, if that IO can verify; ``ExactResume`` triggers saves
through whatever checkpoint callback can take a snapshot on demand.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl


@runtime_checkable
class VerifyingCheckpointIO(Protocol):
    """A ``CheckpointIO`` that can check a file without loading it into a model."""

    def verify_checkpoint(self, path: str) -> None:
        """Return if ``path`` verifies; raise ``CheckpointCorruptError`` naming what is wrong otherwise."""


@runtime_checkable
class SnapshotTarget(Protocol):
    """A checkpoint callback that writes a snapshot when asked (used by ``ExactResume``'s schedule).

    ``accepts_snapshots`` is ``False`` while it should not be asked (e.g. a ``RetentionCheckpoint``
    with no retention rule, which must behave exactly like ``ModelCheckpoint``).
    """

    @property
    def accepts_snapshots(self) -> bool:
        """Whether scheduled snapshots should go through this callback now."""

    def save_snapshot(self, trainer: "pl.Trainer", reason: str) -> str:
        """Write a full checkpoint of ``trainer`` now, count it as a rolling checkpoint, return its path."""
