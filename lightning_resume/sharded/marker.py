"""The commit marker of a sharded checkpoint directory: its format, reading and verifying it, detection.

A sharded checkpoint (``torch.distributed.checkpoint`` shards plus one ``meta.safetensors``) is a
directory that is a checkpoint only once its ``COMMITTED`` marker exists: JSON with the step, the world
size, and the size and SHA-256 of every file the save wrote. On a local filesystem the files sit next to
the marker (format ``/2``). On an object store, where no directory can be renamed atomically, they sit in
a versioned sub-prefix ``.v-<owner>-<pid>-<8 hex>`` that the marker names (format ``/3``): the marker is
one object, replaced whole by one PUT, so a reader sees either the old version or the new one, never a mix.
This module reads that marker and checks a directory against it, through ``storage`` (a URL keeps its
scheme); the protocol that writes it (staging, commit, swap, cleanup) is
``sharded.commit``'s, the DCP metadata checks are ``sharded.safe_pickle``'s. It lives in ``io`` because
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
from typing import Callable, Dict, Iterable, Mapping, Optional, Tuple

from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.format.framing import unique_keys
from lightning_resume.storage import files as storage

DCP_METADATA = ".metadata"
"""DCP's metadata file: a sharded checkpoint's index of every shard."""
META_FILE = "meta.safetensors"
"""The non-sharded part (loop counters, callback state, RNG...): one file of ``lightning_resume.io``'s format."""
MARKER = "COMMITTED"
FORMAT = "lightning-resume/sharded/2"
VERSIONED_FORMAT = "lightning-resume/sharded/3"
"""A marker naming the sub-prefix (``data``) that holds the files it lists: what object stores get."""
MAX_MARKER_BYTES = 64 << 20
"""Largest marker read (a real one is about 100 bytes per file)."""
DATA = re.compile(r"^\.v-(?P<owner>[0-9a-f]{12})-(?P<pid>\d+)-[0-9a-f]{8}$")
"""Names of the versioned sub-prefixes of an object-store checkpoint (``.v-<owner>-<pid>-<8 hex>``, as
``format.atomic`` names its temporaries: the process that created it, where its pid means something)."""
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
    data: str = ""
    """The sub-prefix of ``path`` holding ``files`` (``""``: ``path`` itself; see ``VERSIONED_FORMAT``)."""

    @property
    def location(self) -> str:
        """Where the files the marker lists are: ``path`` or its ``data`` sub-prefix."""
        return storage.join(self.path, self.data) if self.data else self.path


def digest_file(path: str) -> FileDigest:
    """Size and SHA-256 of the file at ``path``: read locally, or in ranged GETs (each retried) from a URL."""
    sha = hashlib.sha256()
    size = 0
    if storage.is_local(path):
        with open(storage.local_path(path), "rb") as handle:
            while chunk := handle.read(_CHUNK):
                sha.update(chunk)
                size += len(chunk)
        return FileDigest(size, sha.hexdigest())
    total = storage.size(path)
    if total is None:
        raise FileNotFoundError(f"{path} is not a file")
    while size < total and (chunk := storage.read_range(path, size, min(size + _REMOTE_CHUNK, total))):
        sha.update(chunk)
        size += len(chunk)
    return FileDigest(size, sha.hexdigest())


_REMOTE_CHUNK = 8 << 20


def digest_files(directory: str, names: Iterable[str]) -> Dict[str, FileDigest]:
    return {name: digest_file(storage.join(directory, name)) for name in sorted(set(names))}


def read_marker(directory: str) -> CommitRecord:
    """Parse ``COMMITTED``; ``CheckpointCorruptError`` if it is absent or malformed."""
    directory = str(directory)
    marker = storage.join(directory, MARKER)
    text = _marker_bytes(directory, marker)
    try:
        body = json.loads(text.decode("utf-8"), object_pairs_hook=unique_keys)  # a key twice is malformed
        files = {str(n): FileDigest(int(d["size"]), str(d["sha256"])) for n, d in body["files"].items()}
        data = str(body["data"]) if body.get("format") == VERSIONED_FORMAT else ""
        record = CommitRecord(directory, int(body["step"]), int(body["world_size"]), files, data)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise CheckpointCorruptError(marker, f"malformed commit marker: {err}") from err
    if body.get("format") not in (FORMAT, VERSIONED_FORMAT):
        raise CheckpointCorruptError(marker, "unknown commit marker format", FORMAT, body.get("format"))
    if body.get("format") == VERSIONED_FORMAT and not DATA.match(data):
        raise CheckpointCorruptError(marker, f"commit marker names an invalid data prefix {data!r}")
    return record


def _marker_bytes(directory: str, marker: str) -> bytes:
    """The marker's bytes, at most ``MAX_MARKER_BYTES``: locally only a regular file (never a FIFO), remotely
    one ranged GET."""
    missing = CheckpointCorruptError(directory, f"no {MARKER} marker: the save never finished; use an older checkpoint")
    try:
        if storage.is_local(marker):
            if not os.path.isfile(storage.local_path(marker)):
                raise missing
            with open(storage.local_path(marker), "rb") as handle:
                text = handle.read(MAX_MARKER_BYTES + 1)
        else:
            text = storage.read_range(marker, 0, MAX_MARKER_BYTES + 1)
    except FileNotFoundError as err:
        raise missing from err
    except OSError as err:
        raise CheckpointCorruptError(marker, f"unreadable commit marker: {err}") from err
    if len(text) > MAX_MARKER_BYTES:
        raise CheckpointCorruptError(marker, "commit marker is larger than MAX_MARKER_BYTES", MAX_MARKER_BYTES)
    return text


def verify_committed(directory: str, digests: bool = True) -> CommitRecord:
    """The marker is there and every file it lists is present with its size (and SHA-256 if ``digests``)."""
    record = read_marker(directory)
    location = record.location
    sizes = _sizes(record)
    for name, expected in record.files.items():
        path = storage.join(location, name)
        if storage.basename(name) != name or name == MARKER or "/" in name or name in ("", ".", ".."):
            raise CheckpointCorruptError(storage.join(directory, MARKER), f"marker lists an invalid file name {name!r}")
        size = sizes(path)
        if size != expected.size:
            raise CheckpointCorruptError(path, "size differs from the commit marker", expected.size, size)
        if digests and digest_file(path).sha256 != expected.sha256:
            raise CheckpointCorruptError(path, "SHA-256 differs from the commit marker", expected.sha256, "other")
    return record


def _sizes(record: CommitRecord) -> Callable[[str], int]:
    """How to get the size of a listed file: ``lstat`` locally (a regular file only, in a data directory that
    is itself no link), one listing of the data prefix on an object store (no links, FIFOs or devices there)."""
    if storage.is_local(record.location):
        if record.data:
            _real_directory(record.location)
        return _regular_file_size
    listed = storage.file_sizes(record.location)

    def size(path: str) -> int:
        found = listed.get(storage.basename(path))
        if found is None:
            raise CheckpointCorruptError(path, "file listed in the commit marker is missing")
        return found

    return size


def _real_directory(path: str) -> None:
    try:
        st = os.lstat(storage.local_path(path))
    except FileNotFoundError as err:
        raise CheckpointCorruptError(path, "data directory named by the commit marker is missing") from err
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointCorruptError(path, "data directory named by the commit marker is not a directory (a link?)")


def _regular_file_size(path: str) -> int:
    """The size of ``path`` if it is a regular file itself: never a symlink (it could lead outside the
    directory), a FIFO (a read blocks for ever) or a device (``/dev/zero`` never ends)."""
    try:
        st = os.lstat(storage.local_path(path))
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
    """Whether ``path`` is a sharded checkpoint directory (committed or not): it holds our marker, DCP's
    metadata or a shard. Such a directory is one checkpoint, never a folder of them."""
    if not storage.is_dir(path):
        return False
    names = {e.name for e in storage.list_dir(path)}
    return bool(names & {MARKER, DCP_METADATA}) or any(n.endswith(".distcp") for n in names)


def named_for_lightning(directory: str) -> str:
    """What Lightning is handed for a checkpoint directory: the directory itself, or on an object store its commit
    marker. Lightning takes the newest of its "last" candidates by ``fs.modified(path)``, which an object store has
    only for an object, never for a prefix (s3fs raises ``IsADirectoryError``); the marker is the object that makes
    the prefix a checkpoint, and its time is the commit's. :func:`marked_directory` maps it back."""
    directory = str(directory)
    return storage.join(directory, MARKER) if storage.is_remote(directory) and storage.is_dir(directory) else directory


def marked_directory(path: str) -> Optional[str]:
    """The sharded checkpoint directory ``path`` names: the directory itself, or, on an object store, the
    directory of its commit marker (what Lightning is handed there: :func:`named_for_lightning`);
    ``None`` for any other path. A listing at most; no object is read."""
    path = str(path)
    parent, name = storage.split(path)
    if name == MARKER and storage.is_remote(path):
        return parent
    return path if storage.is_dir(path) else None


def meta_path(directory: str) -> str:
    """The non-sharded part of a committed sharded checkpoint (``META_FILE``, where its marker says), read from the
    marker alone; ``CheckpointCorruptError`` when it is not committed or its marker lists no such file."""
    record = read_marker(directory)
    if META_FILE not in record.files:
        raise CheckpointCorruptError(storage.join(str(directory), MARKER), f"commit marker does not list {META_FILE}")
    return storage.join(record.location, META_FILE)


def commit_order(directory: str) -> Optional[Tuple[int, float]]:
    """How far training was when ``directory`` was committed: ``(step, commit time)``, for ordering
    candidates newest first. ``None`` when it is not a committed checkpoint of ours (no marker, a hidden
    staging or replaced directory, an unreadable marker)."""
    name = (
        storage.basename(str(directory).rstrip("/"))
        if "://" in str(directory)
        else os.path.basename(os.path.normpath(directory))
    )
    if HIDDEN.match(name):
        return None
    try:
        record = read_marker(directory)
    except (CheckpointCorruptError, OSError):
        return None
    committed = storage.mtime(storage.join(str(directory), MARKER))
    return None if committed is None else (record.step, committed)
