"""The commit marker of a sharded checkpoint directory: its format, reading and verifying it, detection.

A sharded checkpoint (``torch.distributed.checkpoint`` shards plus one ``meta.safetensors``) is a
directory that is a checkpoint only once its ``COMMITTED`` marker exists: JSON with the step, the world
size, and the size and SHA-256 of every file the save wrote. This module reads that marker and checks a
directory against it; the protocol that writes it (staging, commit, swap, cleanup) is
``sharded.commit``'s, the DCP metadata checks are ``io.safe_pickle``'s. It lives in ``io`` because
every reader of checkpoints (``io.verify``, "last" resolution, the CLI) needs it without the sharded
machinery. Knows files and JSON; nothing of DCP, process groups or Lightning.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Dict, Iterable, Mapping, Optional, Tuple

from lightning_resume import storage
from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.io.framing import unique_keys

DCP_METADATA = ".metadata"
"""DCP's metadata file: a sharded checkpoint's index of every shard."""
META_FILE = "meta.safetensors"
"""The non-sharded part (loop counters, callback state, RNG...): one file of ``lightning_resume.io``'s format."""
MARKER = "COMMITTED"
IN_PROGRESS = "IN_PROGRESS"  # written by the first release's in-place saves; still recognised by cleanup
FORMAT = "lightning-resume/sharded/2"
STAGING, REPLACED, DELETED = "partial", "replaced", "deleted"
HIDDEN = re.compile(rf"^\.(?P<name>.+)\.(?P<kind>{STAGING}|{REPLACED}|{DELETED})-[0-9a-f]{{8}}$")
"""Names of the hidden siblings a save or a deletion leaves while it runs (``.<name>.<kind>-<8 hex>``)."""
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


def read_marker(directory: str) -> CommitRecord:
    """Parse ``COMMITTED``; ``CheckpointCorruptError`` if it is absent or malformed."""
    marker = os.path.join(directory, MARKER)
    if not os.path.isfile(marker):
        raise CheckpointCorruptError(directory, f"no {MARKER} marker: the save never finished; use an older checkpoint")
    try:
        with open(marker, encoding="utf-8") as handle:
            body = json.load(handle, object_pairs_hook=unique_keys)  # a key twice is malformed
        files = {str(n): FileDigest(int(d["size"]), str(d["sha256"])) for n, d in body["files"].items()}
        record = CommitRecord(str(directory), int(body["step"]), int(body["world_size"]), files)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
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
        size = _regular_file_size(path)
        if size != expected.size:
            raise CheckpointCorruptError(path, "size differs from the commit marker", expected.size, size)
        if digests and digest_file(path).sha256 != expected.sha256:
            raise CheckpointCorruptError(path, "SHA-256 differs from the commit marker", expected.sha256, "other")
    return record


def _regular_file_size(path: str) -> int:
    """The size of ``path`` if it is a regular file itself: never a symlink (it could lead outside the
    directory), a FIFO (a read blocks for ever) or a device (``/dev/zero`` never ends)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError as err:
        raise CheckpointCorruptError(path, "file listed in the commit marker is missing") from err
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointCorruptError(
            path, "file listed in the commit marker is not a regular file (a link, FIFO or device?)"
        )
    return st.st_size


def pick_newest(records: Iterable[CommitRecord], mtimes: Mapping[str, float]) -> Optional[CommitRecord]:
    """Policy: the highest step wins; equal steps go to the later commit."""
    ranked = sorted(records, key=lambda r: (r.step, mtimes.get(r.path, 0.0), r.path))
    return ranked[-1] if ranked else None


def is_sharded_checkpoint(path: str) -> bool:
    """Whether ``path`` is a sharded checkpoint directory (committed or not): it holds our marker, an
    in-progress file, DCP's metadata or a shard. Such a directory is one checkpoint, never a folder of them."""
    if not storage.is_dir(path):
        return False
    names = {e.name for e in storage.list_dir(path)}
    return bool(names & {MARKER, IN_PROGRESS, DCP_METADATA}) or any(n.endswith(".distcp") for n in names)


def commit_order(directory: str) -> Optional[Tuple[int, float]]:
    """How far training was when ``directory`` was committed: ``(step, commit time)``, for ordering
    candidates newest first. ``None`` when it is not a committed checkpoint of ours (no marker, a hidden
    staging or replaced directory, an unreadable marker)."""
    if HIDDEN.match(os.path.basename(os.path.normpath(directory))):
        return None
    try:
        record = read_marker(directory)
        return record.step, os.path.getmtime(os.path.join(directory, MARKER))
    except (CheckpointCorruptError, OSError):
        return None
