"""Sharded checkpoints: every rank writes its DCP shards, rank 0 commits; loading verifies and reshards.

``api`` holds the entry points, ``commit`` the marker and swap protocol, ``background`` the async
saves (host-buffer staging, background write, commit at the next synchronisation point),
``safe_pickle`` the restricted DCP readers, ``strategy`` the Lightning hook. The non-sharded part of a checkpoint is one
file in ``lightning_resume.io``'s format (one codec, one integrity record for the whole product).
"""

from lightning_resume.sharded.api import (
    ShardedSaveError,
    clean_uncommitted,
    load_full,
    load_meta,
    load_sharded,
    newest_committed,
    save_sharded,
    verify_sharded,
)
from lightning_resume.sharded.background import AsyncShardedSaver, ShardedSaveHandle, save_sharded_async
from lightning_resume.sharded.commit import CommitRecord

__all__ = [
    "AsyncShardedSaver",
    "CommitRecord",
    "ShardedSaveError",
    "ShardedSaveHandle",
    "clean_uncommitted",
    "load_full",
    "load_meta",
    "load_sharded",
    "newest_committed",
    "save_sharded",
    "save_sharded_async",
    "verify_sharded",
]
