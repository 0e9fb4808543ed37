"""The commit protocol of a sharded checkpoint directory: staging, writing the commit marker, swap, cleanup.

A directory is a checkpoint only once its ``COMMITTED`` marker exists (its format, reading and
verification: ``sharded.marker``). The marker is JSON (step, world size, and the size and SHA-256 of every
file the save wrote) and is written last, by rank 0, after every rank has finished and digested its
own files. A save never touches the directory it
replaces: every rank writes into a staging sibling (``.<name>.partial-<hex>``), the marker is
committed inside it, and only then is it swapped under the final name (one atomic
``renameat2(RENAME_EXCHANGE)`` where the filesystem has it; else old aside, new in place, with
:func:`clean_uncommitted` restoring a committed one if a crash fell between the two renames). The
replaced directory is then deleted. So a crash at any instant leaves the old or the new committed
directory under the final name, plus at most hidden leftovers that :func:`clean_uncommitted`
removes.

On an object store (any fsspec URL; ``s3://``) nothing can be renamed atomically, so nothing is: every
rank writes into a fresh versioned sub-prefix of the final name, ``<final>/.v-<owner>-<pid>-<8 hex>``
(named by rank 0, as ``format.atomic`` names its temporaries), and the commit is one PUT of
``<final>/COMMITTED`` (format ``/3``) naming that version and every object in it with its size and
SHA-256. A reader reads the marker once and then only the version it names, so a directory re-saved
under the same name is seen old or new, never a mix; the version the marker named before is deleted
after the PUT. A deletion removes the marker first. Versions no marker names are removed by
:func:`clean_uncommitted` by owner and age (a dead pid of this host at once, anything else after
``format.atomic.STALE_AFTER_S``). This module knows files, objects and JSON; it knows nothing of DCP,
process groups or Lightning.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import secrets
import shutil
import time
import warnings
from typing import Dict, Iterable, List, Optional, Tuple

from lightning_resume.errors import CheckpointCorruptError, ShardedCheckpointWarning
from lightning_resume.format.atomic import STALE_AFTER_S, atomic_write, fsync_directory, owner_token, pid_alive
from lightning_resume.sharded.marker import (
    DATA,
    DELETED,
    FORMAT,
    HIDDEN,
    MARKER,
    REPLACED,
    STAGING,
    VERSIONED_FORMAT,
    CommitRecord,
    pick_newest,
    read_marker,
    verify_committed,
)
from lightning_resume.storage import files as storage


def hidden_sibling(final: str, kind: str) -> str:
    """A fresh hidden name next to ``final`` that cleanup recognises as ours (``.<name>.<kind>-<hex>``)."""
    parent, name = os.path.split(os.path.abspath(final))
    return os.path.join(parent, f".{name}.{kind}-{secrets.token_hex(4)}")


def stage(final: str) -> str:
    """Create the empty staging directory every rank writes into; ``final`` itself is not touched.

    On an object store: a fresh versioned sub-prefix of ``final`` (nothing is created; the objects are)."""
    if storage.is_remote(final):
        return storage.join(final, f".v-{owner_token()}-{os.getpid()}-{secrets.token_hex(4)}")
    os.makedirs(os.path.dirname(os.path.abspath(final)), exist_ok=True)
    staging = hidden_sibling(final, STAGING)
    os.makedirs(staging)
    return staging


def commit(record: CommitRecord) -> None:
    """Write the marker inside the (staging) directory ``record.path``: from here on it is a checkpoint.

    On an object store ``record.path`` is a versioned sub-prefix: the marker goes to its parent (the final
    name) and names it; that one PUT is the commit."""
    body = {
        "format": FORMAT,
        "step": record.step,
        "world_size": record.world_size,
        "files": {name: {"size": d.size, "sha256": d.sha256} for name, d in sorted(record.files.items())},
    }
    where = record.path
    if storage.is_remote(record.path):
        where, version = storage.split(record.path)
        body.update(format=VERSIONED_FORMAT, data=version)
    data = json.dumps(body, indent=1).encode()
    atomic_write(storage.join(where, MARKER), lambda handle: handle.write(data))


def current_version(final: str) -> Optional[str]:
    """On an object store, the versioned sub-prefix the marker of ``final`` names now (read before a commit
    replaces it, so that :func:`publish` can delete it); ``None`` locally or when there is no readable marker."""
    if storage.is_local(final):
        return None
    try:
        return read_marker(final).data or None
    except CheckpointCorruptError:
        return None


def publish(staging: str, final: str, replaced: Optional[str] = None) -> None:
    """Put the committed ``staging`` directory under the name ``final``, replacing what was there.

    On an object store the commit already did (the marker names ``staging``): the version ``replaced``
    (:func:`current_version` before the commit) is deleted."""
    if storage.is_remote(final):
        if replaced and replaced != storage.basename(staging):
            _discard_replaced(storage.join(final, replaced))
        return
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
    removal leaves only that hidden sibling, which :func:`clean_uncommitted` removes (never restores). On an
    object store the marker goes first (from then on nothing is committed there), then the rest.
    """
    if storage.is_remote(path):
        if not DATA.match(storage.basename(path)):
            storage.remove(storage.join(path, MARKER))
        storage.remove(path)
        return
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


def clean_uncommitted(root: str, keep: Iterable[str] = (), now: Optional[float] = None) -> List[str]:
    """Finish or undo what killed saves left under ``root``; return the paths removed.

    A final name left absent by a crash between the two renames of :func:`publish` gets back its
    newest committed staging or replaced sibling; every other hidden directory is removed. Call it only when no save is in flight (at
    the start of a run, before the first save). On an object store: the versions no marker names, by owner
    and age (:func:`_stale_version`; ``now``: the clock, ``time.time()``).
    """
    if storage.is_remote(root):
        return _clean_remote(root, {str(p).rstrip("/") for p in keep}, now)
    _restore_missing_finals(root)
    kept = {os.path.abspath(p) for p in keep}
    removed = []
    for path in _subdirs(root, links=False):
        hidden = HIDDEN.match(os.path.basename(path)) is not None
        if hidden and os.path.abspath(path) not in kept:
            try:
                shutil.rmtree(path)
            except OSError as err:
                warnings.warn(
                    f"could not remove {path} ({err}); it is left in place", ShardedCheckpointWarning, stacklevel=2
                )
                continue
            removed.append(path)
    return removed


def _clean_remote(root: str, kept: Iterable[str], now: Optional[float] = None) -> List[str]:
    now = time.time() if now is None else now
    removed = []
    for entry in storage.list_dir(root):
        if not entry.is_dir or entry.path in kept or entry.name.startswith("."):
            continue
        try:
            named = read_marker(entry.path).data
        except CheckpointCorruptError:
            if storage.exists(storage.join(entry.path, MARKER)):
                continue  # a marker that cannot be read now (or a hostile one): touch nothing it may name
            named = ""
        for version in storage.list_dir(entry.path):
            if version.is_dir and version.name != named and _stale_version(version.path, now):
                try:
                    storage.remove(version.path)
                except OSError as err:
                    warnings.warn(f"could not remove {version.path} ({err})", ShardedCheckpointWarning, stacklevel=3)
                    continue
                removed.append(version.path)
    return removed


def _stale_version(path: str, now: float) -> bool:
    """An unnamed version is a killed save's when its owner is this host and its pid is dead, or, where its
    pid means nothing here (another host, container, boot), when no object in it is younger than
    ``STALE_AFTER_S``: a save in flight elsewhere is never touched."""
    match = DATA.match(storage.basename(path))
    if match is None:
        return False  # not ours: never removed
    if match["owner"] == owner_token():
        return not pid_alive(int(match["pid"]))
    newest = max((e.mtime for e in storage.list_dir(path)), default=0.0)
    return now - newest > STALE_AFTER_S


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
