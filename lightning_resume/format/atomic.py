"""Atomic file commit: a file appears under its final name complete and durable, or not at all.

Local paths: write ``.<name>.tmp-<owner>-<pid>-<8 hex>`` in the same directory, flush and fsync it,
``os.replace`` it over the final name, then fsync the directory so the rename itself survives a
power loss. A kill at any instant leaves the previous file (or nothing, before the first save)
under the final name, plus at worst one temporary that :func:`clean_stale_temporaries` removes
at the next save in that directory. ``<owner>`` identifies where ``<pid>`` means something: host, boot and PID namespace; another
container, another host over NFS or a process after a reboot has another owner, so its pid is never
looked up here (it could name anything).

Remote fsspec paths (``s3://``, ``gs://``, ``memory://``...): upload, then commit. On S3 a checkpoint
(:func:`atomic_upload`) goes up in parallel parts, each retried on its own, completed only when all are in
and aborted otherwise (``storage.multipart``). Elsewhere, and for :func:`atomic_write`, the bytes go to the
final key with ``autocommit=False``; the object appears only at ``commit()`` (a one-shot PUT or the
completion of a multi-part upload), whole; on any failure ``discard()`` aborts the multi-part upload,
so no partial object ever appears under a final name and "last" can never resolve one. A killed
writer leaves at worst an incomplete multi-part upload, invisible to readers. A filesystem that
cannot defer its commit gets a temporary sibling and ``fs.mv``. The whole transfer is retried with
backoff on transient errors (``storage.with_retries``); permanent ones fail at once, naming the URL.
Stale temporaries and incomplete uploads are cleaned remotely too, by owner and age.
This module knows files, not tensors or Lightning.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import socket
import time
from typing import Any, BinaryIO, Callable, List, Optional, Sequence, Tuple

import fsspec

from lightning_resume.storage import files as storage
from lightning_resume.storage import multipart
from lightning_resume.storage.files import is_local, local_path
from lightning_resume.storage.private import read_small

_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<owner>[0-9a-f]{12})-(?P<pid>\d+)-[0-9a-f]{8}$")

STALE_AFTER_S = 24 * 3600.0
"""A temporary whose pid cannot be checked here (another owner: host, boot or PID namespace) is removed only once untouched this long: no save takes a day, and a live one keeps writing."""


def temp_name(final_name: str) -> str:
    return f".{final_name}.tmp-{owner_token()}-{os.getpid()}-{secrets.token_hex(4)}"


def owner_token() -> str:
    """12 hex digits naming this process's host, boot and PID namespace: where two temporaries have the
    same token, the same pid names the same process."""
    return hashlib.sha256("\0".join(_host_identity()).encode()).hexdigest()[:12]


def _host_identity() -> Tuple[str, str, str]:
    """(machine id and host name, boot id, PID namespace): what must match for a pid to mean the same."""
    machine = read_quietly("/etc/machine-id")
    boot = read_quietly("/proc/sys/kernel/random/boot_id")
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{machine}/{socket.gethostname()}", boot, namespace


def read_quietly(path: str) -> str:
    """The stripped text of a small local file, ``""`` if it cannot be read (bounded, never blocking:
    ``private.read_small``); system files such as ``/etc/machine-id`` may be links."""
    return read_small(path, follow_links=True)


def atomic_write(path: str, write: Callable[[BinaryIO], object], mode: int = 0o666) -> None:
    """Run ``write(fileobj)`` into a temporary sibling and commit it as ``path``.

    ``mode``: a local file's permissions (less the umask, as ``open`` does); ``0o600`` for private state."""
    path = str(path)
    if is_local(path):
        _local_atomic_write(local_path(path), write, mode)
    else:
        _remote_write_then_move(path, write)


_CREATE_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
"""A temporary is always a new file of ours: never one someone made first, never through a planted link."""


def _local_atomic_write(path: str, write: Callable[[BinaryIO], object], mode: int) -> None:
    """The temporary is created, renamed and removed relative to one descriptor of the directory, so a
    directory swapped under the path between these steps cannot redirect them."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    dir_fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        atomic_write_in(dir_fd, os.path.basename(path), write, mode)
    finally:
        os.close(dir_fd)


def atomic_write_in(dir_fd: int, name: str, write: Callable[[BinaryIO], object], mode: int = 0o666) -> None:
    """Run ``write(fileobj)`` into a temporary created new (``O_EXCL | O_NOFOLLOW``) in the directory ``dir_fd``
    and rename it to ``name`` there once written and synced; on any error the temporary is removed and the
    error raised. Everything is relative to ``dir_fd``: a directory the caller opened and checked."""
    tmp = temp_name(name)
    try:
        with os.fdopen(os.open(tmp, _CREATE_NEW, mode, dir_fd=dir_fd), "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on a directory; the rename is atomic
        os.fsync(dir_fd)


def atomic_write_named(directory: str, write: Callable[[BinaryIO], str], mode: int = 0o666) -> str:
    """Run ``write(fileobj)`` into a new temporary in the local ``directory`` and commit it under the name
    ``write`` returns (a content-addressed file is named by what was written); that name. Synced, renamed
    (over an existing file of that name: the same content) and the directory synced, as :func:`atomic_write_in`."""
    os.makedirs(directory, exist_ok=True)
    dir_fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    tmp = temp_name("pack")
    try:
        try:
            with os.fdopen(os.open(tmp, _CREATE_NEW, mode, dir_fd=dir_fd), "wb") as f:
                name = write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        with contextlib.suppress(OSError):
            os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return name


def atomic_upload(
    path: str, segments: Sequence[multipart.Segment], options: multipart.UploadOptions = multipart.DEFAULT_UPLOAD
) -> None:
    """Commit the concatenation of ``segments`` as the remote object ``path``, whole or not at all.

    Where the store has a multi-part API (S3), parts cut from the segments upload ``options.concurrency`` at
    a time, each retried on its own, and the object appears when the last is in (``storage.multipart``); any
    other filesystem gets the single-stream upload of :func:`atomic_write`."""
    path = str(path)
    fs, fs_path = fsspec.core.url_to_fs(path)
    client = multipart.client_for(fs, fs_path)
    if client is None:
        _remote_write_then_move(path, lambda f: [f.write(s.data()) for s in segments])
        return
    multipart.upload(path, client, segments, options)
    fs.invalidate_cache(fs_path.rsplit("/", 1)[0] if "/" in fs_path else "")


def _remote_write_then_move(path: str, write: Callable[[BinaryIO], object]) -> None:
    """Upload then commit, the whole transfer retried on transient errors (``write`` may run again)."""
    fs, fs_path = fsspec.core.url_to_fs(path)
    storage.with_retries(lambda: _upload_then_commit(fs, fs_path, write), path, "write")


def _upload_then_commit(fs: fsspec.AbstractFileSystem, fs_path: str, write: Callable[[BinaryIO], object]) -> None:
    parent = fs_path.rsplit("/", 1)[0] if "/" in fs_path else ""
    if parent and not hasattr(fs, "split_path"):  # object stores have no directories (s3fs would create a bucket)
        fs.makedirs(parent, exist_ok=True)
    try:
        f = fs.open(fs_path, "wb", autocommit=False)
    except (TypeError, NotImplementedError, ValueError):
        return _write_temporary_then_move(fs, fs_path, write)
    try:
        write(f)
        f.close()  # uploads what is buffered; with autocommit=False nothing is visible yet
        f.commit()  # the object appears here, whole
    except BaseException:
        _discard_quietly(f)
        raise
    fs.invalidate_cache(parent)
    return None


def _discard_quietly(f: Any) -> None:
    with contextlib.suppress(Exception):  # the original error is the one to report
        f.discard()  # aborts a multi-part upload; the final name never shows a partial object


def _write_temporary_then_move(
    fs: fsspec.AbstractFileSystem, fs_path: str, write: Callable[[BinaryIO], object]
) -> None:
    parent, name = fs_path.rsplit("/", 1) if "/" in fs_path else ("", fs_path)
    tmp = f"{parent}/{temp_name(name)}" if parent else temp_name(name)
    try:
        with fs.open(tmp, "wb") as f:
            write(f)
        fs.mv(tmp, fs_path)
    except BaseException:
        if fs.exists(tmp):
            fs.rm(tmp)
        raise


def fsync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable (no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename is still atomic
    finally:
        os.close(fd)


def fsync_file_and_dir(path: str) -> None:
    """Flush ``path`` and its directory entry to stable storage (local files only; no-op otherwise)."""
    if not os.path.isfile(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_directory(os.path.dirname(os.path.abspath(path)))


def clean_stale_temporaries(directory: str, now: Optional[float] = None, owned_only: bool = False) -> List[str]:
    """Remove temporaries in ``directory`` left by interrupted saves; return what was removed.

    Call it only from a writer, never from a reader. Only names matching ``.<name>.tmp-<owner>-<pid>-<8 hex>``
    are considered: one of this owner (host, boot, PID namespace) when ``<pid>`` is not alive; any other
    (another container or host) only when untouched for ``STALE_AFTER_S`` seconds,
    so a save in flight elsewhere is never touched. ``now`` is the clock (``time.time()``). A remote
    ``directory`` (a URL) is listed through fsspec, and on S3 its incomplete multi-part uploads older
    than ``STALE_AFTER_S`` are aborted too (they have no owner to ask). ``owned_only``: only this owner's
    temporaries of dead pids (no clock, no uploads): the check a writer can afford at every save.
    """
    now = time.time() if now is None else now
    mine = owner_token()
    removed = []
    for entry in storage.list_dir(directory):
        match = _TEMP.match(entry.name)
        if match is None or entry.is_dir:
            continue
        if match["owner"] == mine:
            stale = not pid_alive(int(match["pid"]))
        else:
            stale = not owned_only and now - entry.mtime > STALE_AFTER_S
        if stale and remove_quietly(entry.path):
            removed.append(entry.path)
    uploads = storage.is_remote(directory) and not owned_only
    return removed + (_abort_stale_uploads(str(directory), now) if uploads else [])


def _abort_stale_uploads(directory: str, now: float) -> List[str]:
    """S3 only: abort multi-part uploads under ``directory`` begun more than ``STALE_AFTER_S`` ago."""
    fs, fs_path = fsspec.core.url_to_fs(directory)
    if not hasattr(fs, "list_multipart_uploads"):
        return []
    bucket, _, prefix = fs_path.partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    try:
        uploads = fs.list_multipart_uploads(bucket)
    except Exception:  # noqa: BLE001 - cleanup is best effort; a listing refused is not an error of the save
        return []
    aborted = []
    for upload in uploads or []:
        key, started = str(upload.get("Key", "")), upload.get("Initiated")
        age = now - started.timestamp() if hasattr(started, "timestamp") else 0.0
        if key.startswith(prefix) and "/" not in key[len(prefix) :] and age > STALE_AFTER_S:
            try:
                fs.abort_mpu(bucket, key, upload["UploadId"])
                aborted.append(f"{directory.rstrip('/')}/{key[len(prefix) :]} (incomplete upload)")
            except Exception:  # noqa: BLE001 - best effort, as above
                continue
    return aborted


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (in this PID namespace)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid > 0  # exists but belongs to someone else; out-of-range pids do not exist
    return True


def remove_quietly(path: str) -> bool:
    """Delete ``path`` (any storage); ``False`` instead of an error if it cannot be."""
    try:
        storage.remove(path)
        return True
    except OSError:
        return False
