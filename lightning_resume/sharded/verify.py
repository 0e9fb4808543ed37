"""Verify a sharded checkpoint directory: its commit marker, every file the marker lists, and DCP's metadata."""

from __future__ import annotations

from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.sharded.marker import DCP_METADATA, CommitRecord, verify_committed


def verify_directory(directory: str, digests: bool = True) -> CommitRecord:
    """A sharded checkpoint directory: committed, and every file its marker lists intact."""
    from lightning_resume.sharded.safe_pickle import load_checked_metadata  # DCP only where directories are

    record = verify_committed(directory, digests)
    if DCP_METADATA not in record.files:
        raise CheckpointCorruptError(directory, f"commit marker does not list {DCP_METADATA}")
    load_checked_metadata(record.location, record.files)  # where the files are: the directory or its data prefix
    return record
