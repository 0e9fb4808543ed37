"""Choosing the newest checkpoint that verifies ("last" resolution as a mechanism).

Lightning resolves ``ckpt_path="last"`` to the newest ``last*.ckpt`` by modification time and loads
it blindly. These helpers walk candidates newest first and return the first that verifies, warning
once per skipped file with the reason. They know files only; which candidates to offer is the
caller's decision (the plugin offers the siblings of a failed ``last`` file, ``RetentionCheckpoint``
its own records).
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Callable, Iterable, List, Optional

import fsspec

from lightning_resume.errors import LightningResumeError

CHECKPOINT_SUFFIXES = (".ckpt", ".safetensors")
_LAST_STEM = re.compile(r"^last(-v\d+)?$")


class SkippedCheckpointWarning(UserWarning):
    """A candidate checkpoint failed verification and was passed over."""


def newest_first(paths: Iterable[str]) -> List[str]:
    """Existing ``paths`` ordered by modification time, newest first (ties: name, descending)."""
    stamped = []
    for p in paths:
        try:
            fs, fs_path = fsspec.core.url_to_fs(str(p))
            stamped.append((fs.modified(fs_path).timestamp(), str(p)))
        except (OSError, FileNotFoundError, NotImplementedError):
            continue
    return [p for _, p in sorted(stamped, reverse=True)]


def newest_verified(paths: Iterable[str], verify: Callable[[str], None]) -> Optional[str]:
    """The newest path for which ``verify(path)`` returns; warn naming each one skipped; ``None`` if none."""
    for path in newest_first(paths):
        try:
            verify(path)
        except (LightningResumeError, OSError) as err:
            warnings.warn(f"skipping checkpoint {path}: {err}", SkippedCheckpointWarning, stacklevel=2)
            continue
        return path
    return None


def is_last_name(path: str) -> bool:
    """Whether ``path`` is named like ModelCheckpoint's "last" file (``last.ckpt``, ``last-v1.ckpt``)."""
    stem, _ = os.path.splitext(os.path.basename(str(path)))
    return bool(_LAST_STEM.match(stem))


def sibling_checkpoints(path: str) -> List[str]:
    """Checkpoint-looking files next to ``path`` (not ``path`` itself, not hidden temporaries)."""
    fs, fs_path = fsspec.core.url_to_fs(str(path))
    parent = fs._parent(fs_path)
    try:
        names = fs.ls(parent, detail=False)
    except (OSError, FileNotFoundError):
        return []
    out = []
    for name in names:
        base = os.path.basename(name)
        if name != fs_path and not base.startswith(".") and base.endswith(CHECKPOINT_SUFFIXES):
            out.append(fs.unstrip_protocol(name) if "://" in str(path) else name)
    return out
