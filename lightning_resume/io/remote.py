"""Paths and transfers on any fsspec filesystem, with the URL scheme kept (``s3://``, ``gs://``, ``memory://``).

Joining, listing and naming go through ``fsspec.core.url_to_fs`` and back with ``unstrip_protocol``,
never ``os.path.normpath`` (which turns ``s3://b/k`` into ``s3:/b/k``). Local paths keep their usual
normalised form, so nothing changes for them. Transfers to remote stores are retried with bounded
exponential backoff when the error is transient (5xx, throttling, connection reset, timeout) and
fail at once, naming the URL, when it is permanent (no bucket, no permission). This module knows
paths and errors, not tensors or Lightning.
"""

from __future__ import annotations

import errno
import os
import time
from typing import Callable, List, NamedTuple, Optional, Tuple, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

T = TypeVar("T")

RETRY_ATTEMPTS = 6
"""Tries of one remote transfer (the first included) before a transient error is final."""
RETRY_BASE_S = 0.25
"""First backoff; each retry doubles it, up to ``RETRY_MAX_S``."""
RETRY_MAX_S = 8.0

_TRANSIENT_ERRNOS = frozenset(
    {errno.EREMOTEIO, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EAGAIN, errno.EBUSY, errno.EPIPE}
)


def is_remote(path: str) -> bool:
    fs, _ = fsspec.core.url_to_fs(str(path))
    return not isinstance(fs, LocalFileSystem)


def join(dirpath: str, name: str) -> str:
    """``dirpath/name``: a URL keeps its scheme; a local path is normalised as ``os.path`` does."""
    dirpath = str(dirpath)
    if "://" in dirpath:  # any URL, file:// included: normpath would turn "s3://" into "s3:/"
        return dirpath.rstrip("/") + "/" + name
    return os.path.normpath(os.path.join(dirpath, name))


def split(path: str) -> Tuple[str, str]:
    """(parent, name) of ``path``; a URL's parent keeps its scheme."""
    path = str(path)
    if "://" in path:
        parent, _, name = path.rstrip("/").rpartition("/")
        return parent, name
    return os.path.dirname(path), os.path.basename(path)


class Entry(NamedTuple):
    path: str  # the full URL for a remote directory, the joined path for a local one
    name: str
    mtime: float
    is_dir: bool


def list_dir(dirpath: str) -> List[Entry]:
    """The entries directly in ``dirpath`` (files and sub-directories), ``[]`` if it does not exist.

    Remote names come back as full URLs (s3fs lists scheme-less keys); a sub-directory without a
    modification time (an object-store prefix) gets 0.
    """
    dirpath = str(dirpath)
    fs, fs_path = fsspec.core.url_to_fs(dirpath)
    fs.invalidate_cache(fs_path)  # another process (or a background upload) may have changed it
    try:
        infos = fs.ls(fs_path, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for info in infos:
        name = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
        if not name or str(info["name"]).rstrip("/") == fs_path.rstrip("/"):
            continue  # some stores list the directory itself
        out.append(Entry(join(dirpath, name), name, _mtime(fs, info), info.get("type") == "directory"))
    return out


def _mtime(fs: fsspec.AbstractFileSystem, info: dict) -> float:
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        try:
            return float(value)
        except (TypeError, ValueError):
            continue
    if info.get("type") == "directory":
        return 0.0
    try:
        return float(fs.modified(info["name"]).timestamp())
    except (OSError, NotImplementedError, KeyError):
        return 0.0


def is_dir(path: str) -> bool:
    fs, fs_path = fsspec.core.url_to_fs(str(path))
    try:
        return bool(fs.isdir(fs_path))
    except OSError:
        return False


def exists(path: str) -> bool:
    fs, fs_path = fsspec.core.url_to_fs(str(path))
    return bool(fs.exists(fs_path))


def file_size(path: str) -> Optional[int]:
    """The size in bytes of the file at ``path`` (a URL or a local path), ``None`` if it is not a file."""
    fs, fs_path = fsspec.core.url_to_fs(str(path))
    try:
        return int(fs.size(fs_path)) if fs.isfile(fs_path) else None
    except (OSError, TypeError, ValueError):
        return None


def is_transient(err: BaseException) -> bool:
    """Whether trying again may succeed: server errors, throttling, resets and timeouts; not a missing
    bucket or key, a refused permission, or a bad request."""
    if isinstance(err, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)):
        return False
    if isinstance(err, (ConnectionError, TimeoutError)):
        return True
    if isinstance(err, OSError):
        return err.errno in _TRANSIENT_ERRNOS or err.errno is None and _is_botocore_transient(err)
    return _is_botocore_transient(err)


def _is_botocore_transient(err: BaseException) -> bool:
    """botocore errors that s3fs passes through untranslated: by class and status code, not message text."""
    response = getattr(err, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = response.get("Error", {}).get("Code")
        return (isinstance(status, int) and status >= 500) or code in ("SlowDown", "Throttling", "RequestTimeout")
    return type(err).__name__ in ("EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError")


def with_retries(
    action: Callable[[], T],
    url: str,
    what: str,
    sleep: Callable[[float], None] = time.sleep,
    attempts: Optional[int] = None,
) -> T:
    """Run ``action`` (one whole transfer, safe to repeat); retry transient errors with backoff.

    A permanent error, or a transient one still there after ``RETRY_ATTEMPTS`` tries, is raised as an
    ``OSError`` naming ``url`` and chained to the original.
    """
    tries = RETRY_ATTEMPTS if attempts is None else attempts
    for attempt in range(1, tries + 1):
        try:
            return action()
        except Exception as err:
            if not _is_storage_error(err):
                raise  # the caller's own error (encoding, a staging abort): not a transfer's
            transient = is_transient(err)
            if transient and attempt < tries:
                sleep(min(RETRY_MAX_S, RETRY_BASE_S * 2 ** (attempt - 1)))
                continue
            raise _named(err, url, what, attempt if transient else None) from err
    raise AssertionError("unreachable")  # pragma: no cover


def _is_storage_error(err: BaseException) -> bool:
    module = type(err).__module__.split(".")[0]
    return isinstance(err, OSError) or module in ("botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "adlfs")


def _named(err: Exception, url: str, what: str, attempts: Optional[int]) -> OSError:
    detail = f"{type(err).__name__}: {err}"
    if attempts is None:
        message = f"could not {what} {url}: {detail} (not retried: the error is permanent)"
    else:
        message = f"could not {what} {url} after {attempts} tries: {detail}"
    cls = type(err) if isinstance(err, (FileNotFoundError, PermissionError)) else OSError
    errno_ = err.errno if isinstance(err, OSError) else None
    return cls(message) if errno_ is None else cls(errno_, message)


def require_local(path: str, owner: str) -> None:
    """Refuse a remote ``path`` where only local directories are supported (sharded checkpoints for now:
    their commit marker protocol renames directories, which object stores cannot do atomically)."""
    if is_remote(str(path)):
        from lightning_resume.errors import ConfigurationError

        raise ConfigurationError(
            owner,
            [
                f"{path} is a remote URL; sharded checkpoints are written to local (or mounted shared)"
                " directories only for now: use a local dirpath, or a single-file checkpoint"
                " (SafetensorsCheckpointIO) for remote storage"
            ],
        )
