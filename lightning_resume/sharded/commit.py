"""The commit protocol of a sharded checkpoint directory: staging, writing the commit marker, swap, cleanup.

A directory is a checkpoint only once its ``COMMITTED`` marker exists (its format, reading and
verification: ``io.marker``). The marker is JSON (step, world size, and the size and SHA-256 of every
file the save wrote) and is written last, by rank 0, after every rank has finished and digested its
own files. A save never touches the directory it
replaces: every rank writes into a staging sibling (``.<name>.partial-<hex>``), the marker is
committed inside it, and only then is it swapped under the final name (one atomic
``renameat2(RENAME_EXCHANGE)`` where the filesystem has it; else old aside, new in place, with
:func:`clean_uncommitted` restoring a committed one if a crash fell between the two renames). The
replaced directory is then deleted. So a crash at any instant leaves the old or the new committed
directory under the final name, plus at most hidden leftovers that :func:`clean_uncommitted`
removes. This module knows files and JSON; it knows nothing of DCP, process groups or Lightning.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import secrets
import shutil
import warnings
from typing import Dict, Iterable, List, Optional, Tuple

from lightning_resume.errors import CheckpointCorruptError, ShardedCheckpointWarning
from lightning_resume.io.atomic import atomic_write, fsync_directory
from lightning_resume.io.marker import (
    DCP_METADATA,
    DELETED,
    FORMAT,
    HIDDEN,
    IN_PROGRESS,
    MARKER,
    META_FILE,
    REPLACED,
    STAGING,
    CommitRecord,
    pick_newest,
    verify_committed,
)


def hidden_sibling(final: str, kind: str) -> str:
    """A fresh hidden name next to ``final`` that cleanup recognises as ours (``.<name>.<kind>-<hex>``)."""
    parent, name = os.path.split(os.path.abspath(final))
    return os.path.join(parent, f".{name}.{kind}-{secrets.token_hex(4)}")


def stage(final: str) -> str:
    """Create the empty staging directory every rank writes into; ``final`` itself is not touched."""
    os.makedirs(os.path.dirname(os.path.abspath(final)), exist_ok=True)
    staging = hidden_sibling(final, STAGING)
    os.makedirs(staging)
    return staging


def commit(record: CommitRecord) -> None:
    """Write the marker inside the (staging) directory ``record.path``: from here on it is a checkpoint."""
    body = {
        "format": FORMAT,
        "step": record.step,
        "world_size": record.world_size,
        "files": {name: {"size": d.size, "sha256": d.sha256} for name, d in sorted(record.files.items())},
    }
    data = json.dumps(body, indent=1).encode()
    atomic_write(os.path.join(record.path, MARKER), lambda handle: handle.write(data))


def publish(staging: str, final: str) -> None:
    """Put the committed ``staging`` directory under the name ``final``, replacing what was there."""
    parent = os.path.dirname(os.path.abspath(final))
    if not os.path.lexists(final):
        os.rename(staging, final)
        fsync_directory(parent)
        return
    if _exchange(staging, final):  # one atomic step: final is new, staging now holds the old one
        fsync_directory(parent)
        _discard_replaced(staging)
        return
    replaced = hidden_sibling(final, REPLACED)
    os.rename(final, replaced)  # a crash until the next rename leaves final absent: clean_uncommitted restores it
    try:
        os.rename(staging, final)
    except BaseException:
        os.rename(replaced, final)
        raise
    fsync_directory(parent)
    _discard_replaced(replaced)


def _discard_replaced(path: str) -> None:
    """The new checkpoint is in place: failing to delete the old one must not fail the save."""
    try:
        discard(path)
    except OSError as err:
        warnings.warn(
            f"could not delete the replaced checkpoint {path} ({err}); clean_uncommitted removes it later",
            ShardedCheckpointWarning,
            stacklevel=3,
        )


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths with Linux ``renameat2(RENAME_EXCHANGE)``; ``False`` where unsupported.

    Python's ``os`` has no ``renameat2``; it is called through the C library (glibc >= 2.28).
    """
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"cannot swap {a} and {b}: {os.strerror(code)}")


def discard(path: str) -> None:
    """Delete a checkpoint directory so that no crash leaves a half-deleted one under its name.

    It is first renamed to a hidden ``.deleted-`` sibling (atomic), then removed; a crash during the
    removal leaves only that hidden sibling, which :func:`clean_uncommitted` removes (never restores).
    """
    if not os.path.lexists(path):
        return
    match = HIDDEN.match(os.path.basename(path))
    target = path if match and match["kind"] == DELETED else hidden_sibling(path, DELETED)
    if target != path:
        os.rename(path, target)
        fsync_directory(os.path.dirname(os.path.abspath(path)))
    if os.path.isdir(target) and not os.path.islink(target):
        shutil.rmtree(target)
    else:
        os.remove(target)


def _newest(records: List[CommitRecord]) -> Optional[CommitRecord]:
    return pick_newest(records, {r.path: os.path.getmtime(os.path.join(r.path, MARKER)) for r in records})


def clean_uncommitted(root: str, keep: Iterable[str] = ()) -> List[str]:
    """Finish or undo what killed saves left under ``root``; return the paths removed.

    A final name left absent by a crash between the two renames of :func:`publish` gets back its
    newest committed staging or replaced sibling; every other hidden directory is removed, and so
    is a directory with ``IN_PROGRESS`` and no marker. Call it only when no save is in flight (at
    the start of a run, before the first save).
    """
    _restore_missing_finals(root)
    kept = {os.path.abspath(p) for p in keep}
    removed = []
    for path in _subdirs(root, links=False):
        hidden = HIDDEN.match(os.path.basename(path)) is not None
        if (hidden or _unfinished_save(path)) and os.path.abspath(path) not in kept:
            try:
                shutil.rmtree(path)
            except OSError as err:
                warnings.warn(
                    f"could not remove {path} ({err}); it is left in place", ShardedCheckpointWarning, stacklevel=2
                )
                continue
            removed.append(path)
    return removed


_SAVE_FILE_NAMES = frozenset({IN_PROGRESS, DCP_METADATA, META_FILE})


def _unfinished_save(path: str) -> bool:
    """An in-place save of the first release that never committed: ``IN_PROGRESS``, no marker, and only
    files such a save writes (shards, DCP's metadata, the meta file, hidden temporaries). A directory
    that also holds anything else is a user's directory, never removed for one file's name."""
    if not os.path.isfile(os.path.join(path, IN_PROGRESS)) or os.path.lexists(os.path.join(path, MARKER)):
        return False
    for entry in os.scandir(path):
        ours = entry.name in _SAVE_FILE_NAMES or entry.name.endswith(".distcp") or entry.name.startswith(".")
        if not ours or not entry.is_file(follow_symlinks=False):
            return False
    return True


def _restore_missing_finals(root: str) -> None:
    by_final: Dict[str, List[CommitRecord]] = {}
    for path, final, kind in _hidden_dirs(root):
        if kind != DELETED and not os.path.lexists(final):
            try:
                record = verify_committed(path, digests=False)
            except CheckpointCorruptError:
                continue
            by_final.setdefault(final, []).append(record)
    for final, records in by_final.items():
        newest = _newest(records)
        assert newest is not None  # every list in by_final has a record
        os.rename(newest.path, final)
        fsync_directory(root)


def _hidden_dirs(root: str) -> List[Tuple[str, str, str]]:
    """(hidden directory, the final name it belongs to, its kind) under ``root``."""
    out = []
    for path in _subdirs(root, links=False):
        match = HIDDEN.match(os.path.basename(path))
        if match:
            out.append((path, os.path.join(root, match["name"]), match["kind"]))
    return out


def _subdirs(root: str, links: bool = True) -> List[str]:
    """Directories directly under ``root``; with ``links=False`` no symlink (cleanup: this module creates
    none, and removing through one would report as removed what it only points to)."""
    if not os.path.isdir(root):
        return []
    paths = (os.path.join(root, n) for n in os.listdir(root))
    return sorted(p for p in paths if os.path.isdir(p) and (links or not os.path.islink(p)))
