"""The commit protocol of a sharded checkpoint directory: begin, commit marker, verification, discovery.

A directory is a checkpoint only once its ``COMMITTED`` marker exists. The marker is JSON (step,
world size, and the size and SHA-256 of every file the save wrote) and is written last, by rank 0,
after every rank has finished and digested its own files: temp file, fsync, rename, fsync of the
directory. ``begin`` first drops any old marker, so a directory being rewritten is never "last";
``IN_PROGRESS`` marks directories we started, so cleanup removes only our own stale leftovers.
This module knows files and JSON; it knows nothing of DCP, process groups or Lightning.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional

from lightning_resume.errors import CheckpointCorruptError

MARKER = "COMMITTED"
IN_PROGRESS = "IN_PROGRESS"
FORMAT = "lightning-resume/sharded/1"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileDigest:
    size: int
    sha256: str


@dataclass(frozen=True)
class CommitRecord:
    """What ``COMMITTED`` says about a sharded checkpoint directory."""

    path: str
    step: int
    world_size: int
    files: Dict[str, FileDigest] = field(default_factory=dict)


def digest_file(path: str) -> FileDigest:
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return FileDigest(size, sha.hexdigest())


def digest_files(directory: str, names: Iterable[str]) -> Dict[str, FileDigest]:
    return {name: digest_file(os.path.join(directory, name)) for name in sorted(set(names))}


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes) -> None:
    """Temp file, fsync, rename, fsync of the directory: ``path`` is either absent or whole."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def begin(directory: str) -> None:
    """Make ``directory`` an empty, uncommitted checkpoint directory (rank 0 only, before any rank writes)."""
    marker = os.path.join(directory, MARKER)
    if os.path.exists(marker):  # uncommit first: a crash while clearing must not leave a "committed" husk
        os.remove(marker)
        fsync_dir(directory)
    if os.path.isdir(directory):
        shutil.rmtree(directory)
    elif os.path.exists(directory):
        os.remove(directory)
    os.makedirs(directory)
    write_atomic(os.path.join(directory, IN_PROGRESS), b"")


def commit(record: CommitRecord) -> None:
    """Write the marker (the commit point), then drop ``IN_PROGRESS``."""
    body = {
        "format": FORMAT,
        "step": record.step,
        "world_size": record.world_size,
        "files": {name: {"size": d.size, "sha256": d.sha256} for name, d in sorted(record.files.items())},
    }
    write_atomic(os.path.join(record.path, MARKER), json.dumps(body, indent=1).encode())
    in_progress = os.path.join(record.path, IN_PROGRESS)
    if os.path.exists(in_progress):
        os.remove(in_progress)
        fsync_dir(record.path)


def read_marker(directory: str) -> CommitRecord:
    """Parse ``COMMITTED``; ``CheckpointCorruptError`` if it is absent or malformed."""
    marker = os.path.join(directory, MARKER)
    if not os.path.isfile(marker):
        raise CheckpointCorruptError(directory, f"no {MARKER} marker: the save never finished; use an older checkpoint")
    try:
        with open(marker, encoding="utf-8") as handle:
            body = json.load(handle)
        files = {str(n): FileDigest(int(d["size"]), str(d["sha256"])) for n, d in body["files"].items()}
        record = CommitRecord(str(directory), int(body["step"]), int(body["world_size"]), files)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointCorruptError(marker, f"malformed commit marker: {err}") from err
    if body.get("format") != FORMAT:
        raise CheckpointCorruptError(marker, "unknown commit marker format", FORMAT, body.get("format"))
    return record


def verify_committed(directory: str, digests: bool = True) -> CommitRecord:
    """The marker is there and every file it lists is present with its size (and SHA-256 if ``digests``)."""
    record = read_marker(directory)
    for name, expected in record.files.items():
        path = os.path.join(directory, name)
        if os.path.basename(name) != name or name in (MARKER, IN_PROGRESS):
            raise CheckpointCorruptError(os.path.join(directory, MARKER), f"marker lists an invalid file name {name!r}")
        if not os.path.isfile(path):
            raise CheckpointCorruptError(path, "file listed in the commit marker is missing")
        size = os.path.getsize(path)
        if size != expected.size:
            raise CheckpointCorruptError(path, "size differs from the commit marker", expected.size, size)
        if digests and digest_file(path).sha256 != expected.sha256:
            raise CheckpointCorruptError(path, "SHA-256 differs from the commit marker", expected.sha256, "other")
    return record


def pick_newest(records: Iterable[CommitRecord], mtimes: Mapping[str, float]) -> Optional[CommitRecord]:
    """Policy: the highest step wins; equal steps go to the later commit."""
    ranked = sorted(records, key=lambda r: (r.step, mtimes.get(r.path, 0.0), r.path))
    return ranked[-1] if ranked else None


def committed_under(root: str, digests: bool = True) -> tuple:
    """(verified records, {path: problem}) for every checkpoint directory directly under ``root``."""
    good: List[CommitRecord] = []
    bad: Dict[str, str] = {}
    for path in _subdirs(root):
        if not os.path.exists(os.path.join(path, MARKER)) and not os.path.exists(os.path.join(path, IN_PROGRESS)):
            continue  # not a directory we wrote
        try:
            good.append(verify_committed(path, digests))
        except CheckpointCorruptError as err:
            bad[path] = str(err)
    return good, bad


def newest_committed(root: str, digests: bool = True) -> Optional[str]:
    """The newest directory under ``root`` that is committed and verifies, or ``None``."""
    good, _ = committed_under(root, digests)
    newest = pick_newest(good, {r.path: os.path.getmtime(os.path.join(r.path, MARKER)) for r in good})
    return newest.path if newest else None


def clean_uncommitted(root: str, keep: Iterable[str] = ()) -> List[str]:
    """Remove directories under ``root`` we started (``IN_PROGRESS``) but never committed. Returns them.

    Call it only when no save is in flight (at the start of a run, before the first save).
    """
    kept = {os.path.abspath(p) for p in keep}
    removed = []
    for path in _subdirs(root):
        stale = os.path.exists(os.path.join(path, IN_PROGRESS)) and not os.path.exists(os.path.join(path, MARKER))
        if stale and os.path.abspath(path) not in kept:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _subdirs(root: str) -> List[str]:
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, n) for n in os.listdir(root) if os.path.isdir(os.path.join(root, n)))
