"""Parallel multi-part upload of one object: parts cut from the caller's buffers, committed only when all are in.

The object is the concatenation of ``Segment``s (a checkpoint: its header, then each tensor's bytes, views of
the staging buffers). It is cut into parts of ``UploadOptions.part_size`` bytes (``part_ranges``, a pure
function), and up to ``UploadOptions.concurrency`` parts are in flight at once, each copied out of the
segments it spans only when its upload starts, so beside the caller's buffers at most
``concurrency * part_size`` bytes are held. Part 1 (which holds the header, known only once every tensor is
hashed) goes last, so the other parts upload while the hash runs. Each part is retried on its own when the
error is transient (``storage.with_retries``); a permanent error, or one still there after the retries,
stops the upload, aborts it (no object appears under the name: the previous one, if any, is intact) and is
raised naming the URL and the part's byte range. The object appears only when ``complete`` returns. An
object of one part is one PUT. A SIGKILL leaves an incomplete upload, invisible to readers, which
``format.atomic.clean_stale_temporaries`` aborts once it is old.

The store is reached through the small ``MultipartClient`` protocol: ``S3Multipart`` for s3fs (through its
own client, credentials and endpoint), any other in tests. Which filesystems have one is ``client_for``'s to
say; the others keep ``format.atomic``'s single-stream upload. This module knows bytes and objects, not tensors,
checkpoints or Lightning.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple

from lightning_resume.errors import ConfigurationError
from lightning_resume.storage import files as storage

MIN_PART_SIZE = 5 << 20
"""S3's smallest part (every part but the last)."""
MAX_PARTS = 10_000
"""S3's most parts of one upload: a larger object gets larger parts."""


@dataclass(frozen=True)
class UploadOptions:
    """How an object is uploaded where the store has a multi-part API.

    ``part_size``: bytes of one part (at least 5 MiB; raised for an object that would need more than 10,000
    parts). ``concurrency``: most parts in flight at once; beside the caller's buffers an upload holds at most
    ``part_size * concurrency`` bytes. The defaults (16 MiB, 8) follow S3's guidance of parallel 8-16 MB parts.
    """

    part_size: int = 16 << 20
    concurrency: int = 8

    def __post_init__(self) -> None:
        problems = []
        if type(self.part_size) is not int or self.part_size < MIN_PART_SIZE:
            problems.append(
                f"part_size={self.part_size!r} must be an int >= {MIN_PART_SIZE} (5 MiB, S3's smallest part)"
            )
        if type(self.concurrency) is not int or self.concurrency < 1:
            problems.append(f"concurrency={self.concurrency!r} must be an int >= 1")
        if problems:
            raise ConfigurationError("UploadOptions", problems)

    @property
    def held_bytes(self) -> int:
        """Most bytes an upload holds beside the caller's buffers (the parts in flight)."""
        return self.part_size * self.concurrency


DEFAULT_UPLOAD = UploadOptions()


@dataclass(frozen=True)
class Segment:
    """``size`` bytes of the object, in order; ``data()`` returns them (a buffer of exactly ``size`` bytes),
    blocking until they are final (a tensor still being copied, a header waiting for its digests). It may be
    called more than once (a part retried) and from any thread."""

    size: int
    data: Callable[[], Any]


class MultipartClient(Protocol):
    """One object's multi-part upload on a store: what ``upload`` needs, each call one request."""

    def begin(self) -> str:
        """Start an upload; its id."""

    def put_part(self, upload_id: str, number: int, body: bytearray) -> str:
        """Upload part ``number`` (1-based); its ETag."""

    def complete(self, upload_id: str, etags: Sequence[Tuple[int, str]]) -> None:
        """Make the object appear, whole, from the parts ``(number, etag)``."""

    def abort(self, upload_id: str) -> None:
        """Drop the upload and its parts; nothing appears."""

    def put_whole(self, body: bytearray) -> None:
        """Upload a small object in one request."""


class S3Multipart:
    """``MultipartClient`` over an s3fs filesystem: its own botocore client, so its credentials, endpoint,
    request arguments and client-side retries apply."""

    def __init__(self, fs: Any, bucket: str, key: str) -> None:
        self.fs, self.bucket, self.key = fs, bucket, key

    def _call(self, method: str, **kwargs: Any) -> Any:
        return self.fs.call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs)

    def begin(self) -> str:
        return str(self._call("create_multipart_upload")["UploadId"])

    def put_part(self, upload_id: str, number: int, body: bytearray) -> str:
        return str(self._call("upload_part", UploadId=upload_id, PartNumber=number, Body=body)["ETag"])

    def complete(self, upload_id: str, etags: Sequence[Tuple[int, str]]) -> None:
        parts = [{"PartNumber": n, "ETag": etag} for n, etag in etags]
        self._call("complete_multipart_upload", UploadId=upload_id, MultipartUpload={"Parts": parts})

    def abort(self, upload_id: str) -> None:
        self._call("abort_multipart_upload", UploadId=upload_id)

    def put_whole(self, body: bytearray) -> None:
        self._call("put_object", Body=body)


def client_for(fs: Any, fs_path: str) -> Optional[MultipartClient]:
    """The multi-part client for ``fs_path`` on ``fs``, ``None`` where ``fs`` has no multi-part API (only s3fs
    here; gcsfs, adlfs, ``memory://`` keep the single-stream upload)."""
    if type(fs).__module__.split(".")[0] != "s3fs" or not hasattr(fs, "call_s3"):
        return None
    bucket, key, _ = fs.split_path(fs_path)
    return S3Multipart(fs, bucket, key) if bucket and key else None


def part_ranges(total: int, options: UploadOptions) -> List[Tuple[int, int]]:
    """The ``[start, end)`` byte ranges of the parts of a ``total``-byte object: ``options.part_size`` each (more
    where 10,000 parts would not hold it), the last one shorter; one (maybe empty) range for a small object."""
    size = max(options.part_size, -(-total // MAX_PARTS))
    return [(a, min(a + size, total)) for a in range(0, total, size)] or [(0, 0)]


def upload(
    url: str, client: MultipartClient, segments: Sequence[Segment], options: UploadOptions = DEFAULT_UPLOAD
) -> None:
    """Upload the concatenation of ``segments`` as the object ``url`` through ``client``: all of it, or nothing."""
    ranges = part_ranges(sum(s.size for s in segments), options)
    if len(ranges) == 1:
        body = gather(segments, *ranges[0])
        storage.with_retries(lambda: client.put_whole(body), url, "upload")
        return
    upload_id = storage.with_retries(client.begin, url, "begin the upload of")
    try:
        etags = _put_parts(url, client, upload_id, segments, ranges, options.concurrency)
        storage.with_retries(lambda: client.complete(upload_id, etags), url, "complete the upload of")
    except BaseException:
        with contextlib.suppress(Exception):  # the part's error is the one to report; an upload left is aborted later
            storage.with_retries(lambda: client.abort(upload_id), url, "abort the upload of")
        raise


def _put_parts(
    url: str,
    client: MultipartClient,
    upload_id: str,
    segments: Sequence[Segment],
    ranges: List[Tuple[int, int]],
    concurrency: int,
) -> List[Tuple[int, str]]:
    """Every part, ``concurrency`` at a time, part 1 last; the first failure stops the parts not yet begun."""
    failed = threading.Event()

    def put(number: int) -> Tuple[int, str]:
        if failed.is_set():
            raise _Skipped()
        a, b = ranges[number - 1]
        try:
            body = gather(segments, a, b)
            what = f"upload part {number} (bytes {a}-{b - 1}) of"
            return number, storage.with_retries(lambda: client.put_part(upload_id, number, body), url, what)
        except BaseException:
            failed.set()
            raise

    order = list(range(2, len(ranges) + 1)) + [1]
    pool = concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="lightning-resume-upload")
    try:
        futures = [pool.submit(put, n) for n in order]
        concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        errors = [f.exception() for f in futures if f.done() and f.exception() is not None]
        first = next((e for e in errors if not isinstance(e, _Skipped)), None)
        if first is not None:
            raise first
        return sorted(f.result() for f in futures)
    finally:
        failed.set()  # on any way out (a KeyboardInterrupt too): parts not begun are not sent
        pool.shutdown(wait=True, cancel_futures=True)  # a running part reads the caller's buffers: wait for it


class _Skipped(Exception):
    """A part not sent because another failed first."""


def gather(segments: Sequence[Segment], start: int, end: int) -> bytearray:
    """Bytes ``[start, end)`` of the concatenation of ``segments``, copied out of them once (botocore takes a
    ``bytearray`` as it is; a ``memoryview`` it refuses)."""
    out, at = bytearray(end - start), 0
    view = memoryview(out)
    for s in segments:
        lo, hi = max(start, at), min(end, at + s.size)
        if lo < hi:
            data = memoryview(s.data()).cast("B")
            if len(data) != s.size:
                raise RuntimeError(f"internal error: a segment of {s.size} bytes gave {len(data)}")
            view[lo - start : hi - start] = data[lo - at : hi - at]
        at += s.size
        if at >= end:
            break
    return out
