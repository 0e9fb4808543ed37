"""Sharded checkpoints: every rank writes its DCP shards, rank 0 commits; loading verifies and reshards.

``api`` holds the entry points, ``commit`` the marker protocol, ``safe_pickle`` the restricted DCP
readers, ``meta`` the pickle-free codec of the non-sharded part, ``strategy`` the Lightning hook.
"""

from lightning_resume.sharded.api import (
    clean_uncommitted,
    load_full,
    load_meta,
    load_sharded,
    newest_committed,
    save_sharded,
    verify_sharded,
)
from lightning_resume.sharded.commit import CommitRecord
from lightning_resume.sharded.meta import UnencodableStateError

__all__ = [
    "CommitRecord",
    "UnencodableStateError",
    "clean_uncommitted",
    "load_full",
    "load_meta",
    "load_sharded",
    "newest_committed",
    "save_sharded",
    "verify_sharded",
]
