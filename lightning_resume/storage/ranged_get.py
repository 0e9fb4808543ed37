"""One ranged GET whose answer is checked before it is kept, and every remote call ended by its deadline.

``get`` fetches bytes ``start`` to ``end`` (exclusive) of an object. On S3 (s3fs) the answer's status and
headers are checked first (``expected_length``): a server that ignores ``Range`` and answers the whole object,
or one that answers another range, is refused before any of its body is read; then the body is streamed into a
buffer of the expected length and one byte more is asked for, so a body longer than its headers said is
refused having held the range and no more, and a shorter one is refused as a cut transfer (retried by
``files.with_retries``). Other filesystems are read by their own ``cat_file`` and the length checked after.

``call`` runs one filesystem call within a ``Deadline``: an async filesystem's coroutine (s3fs, gcsfs) runs under
``asyncio.wait_for`` on fsspec's loop and is cancelled when the deadline passes, with every retry of s3fs and
botocore inside it; a synchronous filesystem is checked between calls only. Knows bytes and HTTP answers, not
checkpoints.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, Optional, Tuple

import fsspec.asyn
from fsspec.exceptions import FSTimeoutError

from lightning_resume.errors import RangeMismatchError
from lightning_resume.storage.deadline import Deadline

PIECE = 1 << 16
"""Bytes asked of the body at a time while it is streamed into the range's buffer."""

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def call(fs: Any, name: str, deadline: Deadline, url: str, what: str, *args: Any, **kwargs: Any) -> Any:
    """``fs.<name>(*args, **kwargs)``, ended by ``deadline`` (``RemoteReadTimeoutError`` naming ``url``)."""
    if getattr(fs, "async_impl", False) and not getattr(fs, "asynchronous", False):
        return run(fs, deadline, url, what, getattr(fs, "_" + name), *args, **kwargs)
    if deadline.remaining() <= 0:
        raise deadline.error(url, what)
    return getattr(fs, name)(*args, **kwargs)


def run(fs: Any, deadline: Deadline, url: str, what: str, coroutine: Any, *args: Any, **kwargs: Any) -> Any:
    """The coroutine function ``coroutine(*args, **kwargs)`` run on ``fs``'s loop, cancelled at ``deadline``."""
    left = deadline.remaining()
    if left <= 0:
        raise deadline.error(url, what)
    try:
        return fsspec.asyn.sync(fs.loop, coroutine, *args, timeout=left, **kwargs)
    except FSTimeoutError as err:
        own = err.__cause__
        if own is not None and type(own) not in (TimeoutError, asyncio.TimeoutError):
            raise own from None  # the client's own timeout (a read timeout): a transient error, retried
        raise deadline.error(url, what) from err  # ``wait_for``'s: the deadline passed


def get(fs: Any, fs_path: str, url: str, start: int, end: int, deadline: Deadline) -> Any:
    """Bytes ``start`` to ``end`` (exclusive) of the object, never more; fewer only where the object ends."""
    if end <= start:
        return b""
    if hasattr(fs, "_call_s3") and getattr(fs, "async_impl", False):  # s3fs: headers before the body
        return run(fs, deadline, url, "read", _s3_get, fs, fs_path, url, start, end)
    body = call(fs, "cat_file", deadline, url, "read", fs_path, start=start, end=end)
    if len(body) > end - start:  # held already: a filesystem without streaming; refused all the same
        raise RangeMismatchError(url, start, end, f"{len(body)} bytes", transient=False)
    return body


async def _s3_get(fs: Any, fs_path: str, url: str, start: int, end: int) -> bytearray:
    bucket, key, version = fs.split_path(fs_path)
    extra = {"VersionId": version} if version else {}
    answer = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **extra)
    body = answer["Body"]
    try:
        status = answer.get("ResponseMetadata", {}).get("HTTPStatusCode")
        expected = expected_length(url, start, end, status, answer.get("ContentRange"), answer.get("ContentLength"))
        return await _stream(body, url, start, end, expected)
    finally:
        body.close()  # drops the connection if a refused body was left unread


async def _stream(body: Any, url: str, start: int, end: int, expected: int) -> bytearray:
    """The body into a buffer of ``expected`` bytes, then one byte more asked for: none may come."""
    out, got = bytearray(expected), 0
    while got < expected:
        piece = await body.read(min(PIECE, expected - got))
        if not piece:
            break
        out[got : got + len(piece)] = piece
        got += len(piece)
    if got < expected:
        raise RangeMismatchError(url, start, end, f"a body of {got} bytes where {expected} were due", transient=True)
    if await body.read(1):
        raise RangeMismatchError(url, start, end, f"a body longer than {expected} bytes", transient=False)
    return out


def expected_length(
    url: str, start: int, end: int, status: Optional[int], content_range: Optional[str], length: Optional[int]
) -> int:
    """How many body bytes the answer to a GET of ``start``..``end`` must carry, from its status and headers;
    ``RangeMismatchError`` if they already show it is not that range (a whole object, another offset, more)."""
    want = end - start
    if status == 200:  # Range ignored: the body is the whole object, from byte 0
        if start == 0 and length is not None and length <= want:
            return length  # the whole object lies inside the range: the same bytes
        raise RangeMismatchError(url, start, end, f"the whole object ({_bytes(length)}, HTTP 200)", transient=False)
    first, total = _parse_content_range(content_range)
    if first is not None and first != start:
        raise RangeMismatchError(url, start, end, f"bytes from offset {first} ({content_range})", transient=False)
    expected = want if total is None else max(min(end, total) - start, 0)
    if length is not None and length != expected:
        raise RangeMismatchError(url, start, end, f"a Content-Length of {length}", transient=length < expected)
    return expected


def _parse_content_range(value: Optional[str]) -> Tuple[Optional[int], Optional[int]]:
    match = _CONTENT_RANGE.fullmatch((value or "").strip())
    if match is None:
        return None, None
    return int(match.group(1)), None if match.group(3) == "*" else int(match.group(3))


def _bytes(n: Optional[int]) -> str:
    return "length not given" if n is None else f"{n} bytes"
