"""The one storage layer: local paths and every fsspec URL (``s3://``, ``gs://``, ``memory://``) behind one interface.

Every module that lists, tests, opens or removes a file goes through these functions, so a
URL keeps its scheme everywhere (never ``os.path.normpath``, which turns ``s3://b/k`` into ``s3:/b/k``)
and tests run on ``memory://`` or a local temporary directory instead of patching ``os``. Local paths
take the direct ``os`` route (plain reads, no fsspec buffering, tolerant of a file deleted between a
listing and a stat); URLs go through ``fsspec.core.url_to_fs``, with listings uncached (another process,
or a background upload, may have changed the store a moment ago). Transfers to remote stores are
retried with bounded exponential backoff when the error is transient (5xx, throttling, connection
reset, timeout) and fail at once, naming the URL, when it is permanent (no bucket, no permission). Every
remote read ends by a ``Deadline`` (one per load, given by the caller, or a default one per read), every retry
of every layer included; a ranged read gets the range it asked for or an error (``storage.ranged_get``).

Which entries of a directory are checkpoints is not decided here (``io.resolve.candidates``), nor how
a file is committed atomically, its rename included (``format.atomic``). This module knows paths and errors, not checkpoints,
tensors or Lightning.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import errno
import functools
import io
import os
import shutil
import time
from typing import IO, Any, Callable, Deque, Dict, List, NamedTuple, Optional, Tuple, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from lightning_resume.errors import RangeMismatchError, RemoteReadTimeoutError
from lightning_resume.storage import ranged_get
from lightning_resume.storage.deadline import Deadline, or_default

T = TypeVar("T")

RETRY_ATTEMPTS = 6
"""Tries of one remote transfer (the first included) before a transient error is final."""
RETRY_BASE_S = 0.25
"""First backoff; each retry doubles it, up to ``RETRY_MAX_S``."""
RETRY_MAX_S = 8.0

_TRANSIENT_ERRNOS = frozenset(
    {errno.EREMOTEIO, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EAGAIN, errno.EBUSY, errno.EPIPE}
)


class Entry(NamedTuple):
    """One entry directly in a directory: ``path`` is the full URL (scheme kept) or the joined local path."""

    path: str
    name: str
    mtime: float
    is_dir: bool


# ------------------------------------------------------------------------------------------ naming


def is_local(path: str) -> bool:
    """Whether ``path`` is on the local filesystem (a plain path or a ``file://`` URL)."""
    fs, _ = fsspec.core.url_to_fs(str(path))
    return isinstance(fs, LocalFileSystem)


def is_remote(path: str) -> bool:
    return not is_local(path)


def local_path(path: str) -> str:
    """The filesystem path of a local ``file://`` URL (or the path itself)."""
    path = str(path)
    return fsspec.core.url_to_fs(path)[1] if "://" in path else path


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


def basename(path: str) -> str:
    return split(path)[1]


# ----------------------------------------------------------------------------------------- queries


def list_dir(dirpath: str) -> List[Entry]:
    """The entries directly in ``dirpath`` (files and sub-directories), by name; ``[]`` if it does not exist.

    An entry deleted between the listing and its stat (a concurrent prune) is left out. A remote
    sub-directory without a modification time (an object-store prefix) gets 0.
    """
    dirpath = str(dirpath)
    if not is_local(dirpath):
        return sorted(_list_remote(dirpath), key=lambda e: e.name)
    out = []
    try:
        with os.scandir(local_path(dirpath)) as it:
            for item in it:
                try:
                    out.append(Entry(join(dirpath, item.name), item.name, item.stat().st_mtime, item.is_dir()))
                except FileNotFoundError:
                    continue  # gone since the listing: not an entry any more
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(out, key=lambda e: e.name)


def _list_remote(dirpath: str) -> List[Entry]:
    fs, fs_path = fsspec.core.url_to_fs(dirpath)
    fs.invalidate_cache(fs_path)  # another process (or a background upload) may have changed it
    try:  # a refused listing names the URL (a raw botocore error names nothing); transient ones are retried
        infos = _listing(fs, fs_path, dirpath)
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


def file_sizes(dirpath: str) -> Dict[str, int]:
    """The regular files directly in ``dirpath`` by name, with their sizes, from one listing (one LIST on an
    object store, uncached); ``{}`` if it does not exist. Local links and special files are left out."""
    dirpath = str(dirpath)
    if is_local(dirpath):
        out = {}
        with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(local_path(dirpath)) as it:
            for item in it:
                with contextlib.suppress(FileNotFoundError):
                    if item.is_file(follow_symlinks=False):
                        out[item.name] = item.stat(follow_symlinks=False).st_size
        return out
    fs, fs_path = fsspec.core.url_to_fs(dirpath)
    fs.invalidate_cache(fs_path)
    try:
        infos = _listing(fs, fs_path, dirpath)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    return {
        str(i["name"]).rstrip("/").rsplit("/", 1)[-1]: int(i.get("size") or 0)
        for i in infos
        if i.get("type") == "file" and str(i["name"]).rstrip("/") != fs_path.rstrip("/")
    }


def _listing(fs: Any, fs_path: str, url: str) -> List[dict]:
    """One uncached listing, retried, ended by a default deadline."""
    deadline = Deadline.after()
    return list(
        with_retries(
            lambda: ranged_get.call(fs, "ls", deadline, url, "list", fs_path, detail=True),
            url,
            "list",
            deadline=deadline,
        )
    )


def exists(path: str, deadline: Optional[Deadline] = None) -> bool:
    """Whether ``path`` exists; remotely ended by ``deadline`` (a default one if not given)."""
    if is_local(path):
        return os.path.lexists(local_path(path))
    fs, fs_path = fsspec.core.url_to_fs(str(path))
    fs.invalidate_cache()  # a listing cached earlier may predate another process's upload
    return bool(ranged_get.call(fs, "exists", or_default(deadline), str(path), "find", fs_path))


def is_dir(path: str) -> bool:
    if is_local(path):
        return os.path.isdir(local_path(path))
    fs, fs_path = fsspec.core.url_to_fs(str(path))
    try:
        return bool(fs.isdir(fs_path))
    except OSError:
        return False


def size(path: str, deadline: Optional[Deadline] = None) -> Optional[int]:
    """The size in bytes of the file at ``path``, ``None`` if it is not a file (missing, or a directory).
    Remotely one ``info`` call, ended by ``deadline`` (a default one if not given)."""
    if is_local(path):
        try:
            return os.path.getsize(local_path(path)) if os.path.isfile(local_path(path)) else None
        except OSError:
            return None
    fs, fs_path = fsspec.core.url_to_fs(str(path))
    try:
        info = ranged_get.call(fs, "info", or_default(deadline), str(path), "find the size of", fs_path)
        return int(info["size"]) if info.get("type") == "file" else None
    except RemoteReadTimeoutError:
        raise
    except (OSError, TypeError, ValueError, KeyError):
        return None


def mtime(path: str) -> Optional[float]:
    """The modification time of ``path`` (seconds since the epoch), ``None`` if it is gone or has none."""
    if is_local(path):
        try:
            return os.path.getmtime(local_path(path))
        except OSError:
            return None
    fs, fs_path = fsspec.core.url_to_fs(str(path))
    try:
        return float(fs.modified(fs_path).timestamp())
    except (OSError, NotImplementedError, ValueError):
        return None


# ---------------------------------------------------------------------------------- reading, writing


def open_read(path: str) -> IO[bytes]:
    """``path`` opened for binary reading: locally unbuffered (every byte read once, into the caller's
    buffer), remotely through fsspec (ranged reads, only what is asked for is fetched)."""
    if is_local(path):
        return open(local_path(path), "rb", buffering=0)
    fs, fs_path = fsspec.core.url_to_fs(str(path))
    return fs.open(fs_path, "rb")


def read_bytes(path: str, deadline: Optional[Deadline] = None) -> bytes:
    """The whole file at ``path`` in one read (one GET on an object store). ``FileNotFoundError`` if missing.
    Remotely ended by ``deadline`` (a default one if not given), every retry included."""
    if is_local(path):
        with open_read(path) as f:
            return f.read()
    fs, fs_path = fsspec.core.url_to_fs(str(path))
    url, deadline = str(path), or_default(deadline)
    get = functools.partial(ranged_get.call, fs, "cat_file", deadline, url, "read", fs_path)
    return bytes(with_retries(get, url, "read", deadline=deadline))


def read_range(path: str, start: int, end: int, deadline: Optional[Deadline] = None) -> bytes:
    """Bytes ``start`` to ``end`` (exclusive) of ``path``, and no more: a ranged GET on an object store (an
    fsspec file object would read ahead a whole block), ``pread`` locally. Shorter only at the end of the file.
    Remotely the answer must be that range (``ranged_get.get``) and come by ``deadline`` (a default one if not
    given), every retry included."""
    if is_local(path):
        with open_read(path) as f:
            return os.pread(f.fileno(), max(end - start, 0), start)
    fs, fs_path = fsspec.core.url_to_fs(str(path))
    url, deadline = str(path), or_default(deadline)
    get = functools.partial(ranged_get.get, fs, fs_path, url, start, end, deadline)
    return bytes(with_retries(get, url, "read", deadline=deadline))


READ_CHUNK = 4 << 20
"""Bytes of one ranged GET of a :class:`RangedReader`. The client holds each chunk about twice while it
arrives (s3fs joins the pieces aiohttp received): ``reader_overhead`` counts it so."""


READER_WINDOW = 8 * READ_CHUNK
"""Most bytes a :class:`RangedReader` has in flight, one ranged GET of ``READ_CHUNK`` per stream."""


def reader_window(size: int) -> int:
    """The bytes a :class:`RangedReader` over a file of ``size`` bytes keeps in flight: about 1/8 of it, whole
    chunks, from one chunk to ``READER_WINDOW``."""
    return max(READ_CHUNK, min(READER_WINDOW, size // 8 // READ_CHUNK * READ_CHUNK))


def reader_streams(size: int) -> int:
    """Ranged GETs a :class:`RangedReader` over a file of ``size`` bytes keeps in flight (``reader_window`` of them)."""
    return reader_window(size) // READ_CHUNK


def reader_overhead(size: int) -> int:
    """Host bytes a :class:`RangedReader` holds beside what its reader builds: each stream's chunk while it
    arrives (the client holds it about twice), and the chunk being read."""
    return (2 * reader_streams(size) + 1) * READ_CHUNK


class RangedReader(io.RawIOBase):
    """A read-only, seekable file over a remote object of known ``size``: ranged GETs of ``READ_CHUNK`` bytes
    (each retried), ``reader_streams`` of them always in flight ahead of the read position, so the network
    never waits for the reader to copy, nor the reader for a batch of GETs to finish (a read-ahead pipeline:
    the same requests, at the same concurrency, as a raw parallel download). A reader copies the bytes it
    asks for straight from the chunk that holds them into its own memory (``readinto``), so reading a whole
    checkpoint holds ``reader_overhead`` bytes beside what is built from it, never the file. A seek away from
    the next bytes drops what was read ahead and starts again there. Each GET must answer the range it asked
    for (``ranged_get.get``: a longer body is refused before more than the range is held) and ends by
    ``deadline``, the load's (every GET its own default one if not given)."""

    def __init__(self, path: str, size: int, deadline: Optional[Deadline] = None) -> None:
        super().__init__()
        self.path, self.size = str(path), int(size)
        self._deadline = deadline
        self.streams = reader_streams(self.size)
        self._fs, self._fs_path = fsspec.core.url_to_fs(self.path)
        self._pool = concurrent.futures.ThreadPoolExecutor(self.streams, thread_name_prefix="lightning-resume-read")
        self._ahead: Deque[Tuple[int, concurrent.futures.Future]] = collections.deque()
        self._next = 0  # the start of the next chunk to request
        self._chunk_start, self._chunk = 0, memoryview(b"")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        out, done = memoryview(b).cast("B"), 0
        while done < len(out) and self._pos < self.size:
            if not self._chunk_start <= self._pos < self._chunk_start + len(self._chunk) and not self._advance():
                break  # the object is shorter than its listed size: the caller sees a short read
            at = self._pos - self._chunk_start
            n = min(len(out) - done, len(self._chunk) - at)
            out[done : done + n] = self._chunk[at : at + n]
            done, self._pos = done + n, self._pos + n
        return done

    def _advance(self) -> bool:
        """Make the chunk that holds the read position current; ``False`` if the object ends before it."""
        start = self._pos - self._pos % READ_CHUNK
        while self._ahead and self._ahead[0][0] < start:
            self._ahead.popleft()[1].cancel()  # passed over by a seek forward
        if not self._ahead or self._ahead[0][0] != start:
            self._drop_ahead()
            self._next = start
        self._request()
        self._chunk_start, future = self._ahead.popleft()
        self._chunk = memoryview(future.result())
        self._request()  # keep ``streams`` GETs in flight while this chunk is read
        return self._pos < self._chunk_start + len(self._chunk)

    def _request(self) -> None:
        while len(self._ahead) < self.streams and self._next < self.size:
            at, end = self._next, min(self._next + READ_CHUNK, self.size)
            deadline = or_default(self._deadline)
            get = functools.partial(ranged_get.get, self._fs, self._fs_path, self.path, at, end, deadline)
            self._ahead.append((at, self._pool.submit(with_retries, get, self.path, "read", deadline=deadline)))
            self._next = end

    def _drop_ahead(self) -> None:
        while self._ahead:
            self._ahead.popleft()[1].cancel()  # one already running only fills its own bytes, then is dropped

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        if not self.closed:
            self._drop_ahead()
            self._chunk = memoryview(b"")
            self._pool.shutdown(wait=True, cancel_futures=True)  # no GET outlives the reader
        super().close()


def remove(path: str) -> None:
    """Delete the file or directory tree at ``path``; a path already gone is not an error (a concurrent
    prune carried out the same decision). Remote deletions are retried like uploads."""
    path = str(path)
    if is_local(path):
        target = local_path(path)
        with contextlib.suppress(FileNotFoundError):
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            else:
                os.remove(target)
        return
    fs, fs_path = fsspec.core.url_to_fs(path)

    def rm() -> None:
        with contextlib.suppress(FileNotFoundError):
            fs.rm(fs_path, recursive=True)

    with_retries(rm, path, "delete")


def check_writable(dirpath: str) -> None:
    """Fail now, naming ``dirpath``, if checkpoints can be neither written nor listed under it (a missing bucket,
    a bucket or prefix without permission), instead of at the first save, maybe an epoch later. Remote only
    (a local directory is created by the first save). On S3 a multi-part upload is begun and aborted under
    the prefix (``s3:PutObject``, nothing ever visible); elsewhere an empty ``.lightning-resume-probe-<pid>``
    is written and removed. Then the prefix is listed (what ``ckpt_path="last"`` does; an empty prefix is
    fine). Transient errors are retried as transfers are; a permanent one raises at once."""
    dirpath = str(dirpath)
    if is_local(dirpath):
        return
    fs, fs_path = fsspec.core.url_to_fs(dirpath)
    probe = fs_path.rstrip("/") + f"/.lightning-resume-probe-{os.getpid()}"

    def write_probe() -> None:
        if hasattr(fs, "call_s3"):
            bucket, key, _ = fs.split_path(probe)
            upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload["UploadId"])
        else:
            fs.pipe_file(probe, b"")
            fs.rm(probe)

    def list_prefix() -> None:
        with contextlib.suppress(FileNotFoundError):  # nothing saved there yet
            fs.ls(fs_path, refresh=True)

    with_retries(write_probe, dirpath, "write checkpoints under")
    with_retries(list_prefix, dirpath, "list checkpoints under")


# ------------------------------------------------------------------------------------------ retries


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
    return type(err).__name__ in _TRANSIENT_NAMES


_TRANSIENT_NAMES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "AioReadTimeoutError",
        "ResponseStreamingError",  # a body cut mid-transfer (botocore/aiobotocore)
        "IncompleteReadError",
        "ClientPayloadError",  # aiohttp: the body ended before its Content-Length
    }
)


def with_retries(
    action: Callable[[], T],
    url: str,
    what: str,
    sleep: Callable[[float], None] = time.sleep,
    attempts: Optional[int] = None,
    deadline: Optional[Deadline] = None,
) -> T:
    """Run ``action`` (one whole transfer, safe to repeat); retry transient errors with backoff.

    A permanent error, or a transient one still there after ``RETRY_ATTEMPTS`` tries, is raised as an
    ``OSError`` naming ``url`` and chained to the original (a ``RangeMismatchError``, which names the URL and
    the range already, as it is). With a ``deadline`` (which ``action`` should end by, too), no try starts and no backoff is slept past
    it: ``RemoteReadTimeoutError`` instead.
    """
    tries = RETRY_ATTEMPTS if attempts is None else attempts
    for attempt in range(1, tries + 1):
        try:
            return action()
        except RemoteReadTimeoutError:
            raise  # the deadline passed inside the transfer: no time is left for another try
        except Exception as err:
            if not _is_storage_error(err):
                raise  # the caller's own error (encoding, a staging abort): not a transfer's
            transient = is_transient(err)
            if transient and attempt < tries:
                pause = min(RETRY_MAX_S, RETRY_BASE_S * 2 ** (attempt - 1))
                if deadline is not None and deadline.remaining() <= pause:
                    raise deadline.error(url, what) from err
                sleep(pause)
                continue
            if isinstance(err, RangeMismatchError):
                raise  # names the URL and the range itself
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
