"""Which checkpoint to resume from: the newest candidate that verifies (the one resolver).

Lightning resolves ``ckpt_path="last"`` to the newest ``last*.ckpt`` by modification time and loads it
blindly. :func:`newest_verified` walks candidates newest first and returns the first that passes
``io.verify.verify``, reporting each one skipped with the reason. It is the only such search in the
package: the plugin offers the siblings of a ``last`` file that failed, ``RetentionCheckpoint`` the
files of its ``dirpath``, sharded runs their committed directories, the CLI the checkpoints of a
directory. Which candidates to offer, and how to order them, is the caller's choice; the search is here.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any, Callable, Iterable, Optional

import fsspec

from lightning_resume.errors import LightningResumeError, SkippedCheckpointWarning
from lightning_resume.io.verify import verify as verify_checkpoint

CHECKPOINT_SUFFIXES = (".ckpt", ".safetensors")
_LAST_STEM = re.compile(r"^last(-v\d+)?$")

Verify = Callable[[str], object]
"""Returns (any value, ignored) if a path verifies, raises naming the problem otherwise (any exception skips the path)."""
Skipped = Callable[[str], None]
"""Told one line per candidate passed over."""


def modified_time(path: str) -> Any:
    """Default order: the modification time (``None`` if the path is gone)."""
    try:
        fs, fs_path = fsspec.core.url_to_fs(str(path))
        return fs.modified(fs_path).timestamp()
    except (OSError, NotImplementedError):
        return None


def warn_skipped(line: str) -> None:
    warnings.warn(line, SkippedCheckpointWarning, stacklevel=3)


def newest_verified(
    paths: Iterable[str],
    verify: Optional[Verify] = None,
    key: Callable[[str], Any] = modified_time,
    skipped: Skipped = warn_skipped,
) -> Optional[str]:
    """The newest of ``paths`` (greatest ``key``, ties: the greater path) that verifies; ``None`` if none.

    ``verify`` defaults to ``io.verify.verify``. Paths whose ``key`` is ``None`` (gone) are ignored;
    each one that does not verify is reported through ``skipped``, naming it and why.
    """
    check = verify if verify is not None else verify_checkpoint
    keyed = [(k, str(p)) for p in paths if (k := key(str(p))) is not None]
    for _, path in sorted(keyed, reverse=True):
        try:
            check(path)
        except Exception as err:  # noqa: BLE001 - one odd sibling (any reader error) must not stop the search
            reason = str(err) if isinstance(err, (LightningResumeError, OSError)) else f"{type(err).__name__}: {err}"
            skipped(f"skipping checkpoint {path}: {reason}")
            continue
        return path
    return None


def is_last_name(path: str) -> bool:
    """Whether ``path`` is named like ModelCheckpoint's "last" file (``last.ckpt``, ``last-v1.ckpt``)."""
    stem, _ = os.path.splitext(os.path.basename(str(path)))
    return bool(_LAST_STEM.match(stem))


def sibling_checkpoints(path: str) -> list[str]:
    """Checkpoint-looking files next to ``path`` (not ``path`` itself, not hidden temporaries)."""
    fs, fs_path = fsspec.core.url_to_fs(str(path))
    parent = fs_path.rsplit("/", 1)[0] if "/" in fs_path else ""
    try:
        names = fs.ls(parent, detail=False)
    except OSError:
        return []
    out = []
    for name in names:
        base = os.path.basename(name)
        if name != fs_path and not base.startswith(".") and base.endswith(CHECKPOINT_SUFFIXES):
            out.append(fs.unstrip_protocol(name) if "://" in str(path) else name)
    return out
