"""Writing a checkpoint file: encode the tree, write the tensors, hash them, commit atomically.

Encode the whole tree first (so an unencodable value fails before any file is touched), then,
through ``atomic_write``, write the tensor bytes after a placeholder header while a thread hashes
them, and the real header last; one fsync. Locally the bytes go straight from tensor memory to the
file descriptor, with writeback started as they go; an async snapshot (one block-aligned image of
the data section) is written with direct I/O instead, where the filesystem allows. A remote file is
uploaded as segments (header, then each tensor) while it is hashed, through ``atomic_upload``: in parallel
parts on S3 (``storage.multipart``), the header's part last. This module knows files and tensors, not Lightning.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import fcntl
import functools
import mmap as mmap_module
import os
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from lightning_resume.format import framing, integrity, packs
from lightning_resume.format.atomic import atomic_upload, atomic_write
from lightning_resume.format.framing import BLOCK, FORMAT_KEY, FORMAT_VALUE, INTEGRITY_KEY, TREE_KEY
from lightning_resume.storage import files as storage
from lightning_resume.storage import multipart
from lightning_resume.threads import Background


def save_file(
    checkpoint: Dict[str, Any],
    path: str,
    algorithm: str = integrity.DEFAULT_ALGORITHM,
    upload: multipart.UploadOptions = multipart.DEFAULT_UPLOAD,
) -> None:
    """Encode ``checkpoint`` and commit it atomically at ``path`` (``upload``: see :func:`commit`)."""
    tree_json, tensors = encode_tree(checkpoint)  # fails on an unencodable value before any file exists
    commit(path, tree_json, tensors, algorithm, upload=upload)


def encode_tree(checkpoint: Dict[str, Any]) -> Tuple[str, Dict[str, torch.Tensor]]:
    """The typed JSON text of ``checkpoint`` and its tensors by name (the tensors are not copied)."""
    from lightning_resume.format.codec import encode, to_json  # imports Lightning: not needed by a commit alone

    encoded = encode(checkpoint)
    return to_json(encoded.tree), encoded.tensors


def commit(
    path: str,
    tree_json: str,
    tensors: Dict[str, torch.Tensor],
    algorithm: str = integrity.DEFAULT_ALGORITHM,
    ready: Optional[Callable[[str], None]] = None,
    image: Optional[memoryview] = None,
    mode: int = 0o666,
    upload: multipart.UploadOptions = multipart.DEFAULT_UPLOAD,
    refs: packs.Refs = packs.NO_REFS,
) -> None:
    """Write an encoded checkpoint (from :func:`encode_tree`) atomically at ``path``, hashing while writing.

    ``ready(name)``, when given, blocks until ``tensors[name]`` holds its bytes (an async snapshot still
    being copied, in file order): each tensor is written and hashed as soon as it is ready.
    ``image``, when given, is the data section as one buffer (the tensors are views of it, back to
    back in file order; start and length multiples of ``BLOCK``): a local file is then written from it
    with direct I/O, no page-cache copy, where the filesystem allows. The file is the same either way.
    ``mode``: a local file's permissions (``atomic_write``). ``upload``: part size and concurrency of an upload
    to a store with a multi-part API (``storage.multipart``); a remote file is uploaded while it is hashed.
    ``refs``: tensors kept out of the data section, referenced in committed packs (``format.packs``; a dedupe
    save): listed in the integrity record after the inline ones, by name, and in the refs record.
    """
    wait = ready if ready is not None else _always_ready
    entries = framing.layout(tensors)
    views = [framing.host_bytes(tensors[e.name]) for e in entries]  # staged tensors: views, no copy

    referenced = sorted(refs.tensors.values(), key=lambda r: r.name)

    def header(digests: Dict[str, str], align: int = 8) -> bytes:
        listed, known = entries + [r.entry() for r in referenced], digests.copy()  # a placeholder's defaultdict too
        known.update({r.name: r.key for r in referenced})
        record = integrity.make_record(algorithm, tree_json, listed, known)
        meta = {FORMAT_KEY: FORMAT_VALUE, TREE_KEY: tree_json, INTEGRITY_KEY: record}
        if refs.lineage:
            meta[packs.REFS_KEY] = packs.refs_metadata(refs.lineage, referenced, refs.wrote)
        return framing.header_bytes(entries, meta, align)

    def write(f: BinaryIO) -> None:  # a local temporary file (``atomic_write``)
        data = _Data(entries, views, wait)
        if image is None or not _write_direct(f, header, data, image, algorithm):
            _write_hashing_during_flush(f, header, data, algorithm)

    if storage.is_remote(path):
        _upload_hashing_during_upload(path, header, _Data(entries, views, wait), algorithm, upload)
    else:
        atomic_write(path, write, mode)


def _upload_hashing_during_upload(
    path: str, header: Callable[..., bytes], data: _Data, algorithm: str, options: multipart.UploadOptions
) -> None:
    """Upload the file as segments (the header, then each tensor's bytes as it is ready) while a thread
    hashes them: the header's segment, which waits for the digests, is the one ``storage.multipart`` sends last."""
    hasher = Background(_digests, algorithm, data)
    blank = "0" * len(integrity.digest(algorithm, b""))
    size = len(header(defaultdict(lambda: blank)))

    def final_header() -> bytes:
        final = header(hasher.result())
        if len(final) != size:
            raise RuntimeError("internal error: header length changed between placeholder and final header")
        return final

    def tensor(e: framing.Entry, view: memoryview) -> multipart.Segment:
        def ready_bytes() -> memoryview:
            data.wait(e.name)
            return view

        return multipart.Segment(len(view), ready_bytes)

    segments = [multipart.Segment(size, final_header)]
    segments += [tensor(e, view) for e, view in zip(data.entries, data.views, strict=True)]
    try:
        atomic_upload(path, segments, options)
    finally:
        hasher.join()  # on a failed upload too: the hasher reads memory the caller may reuse once we return


def _always_ready(name: str) -> None:
    return None


@dataclass(frozen=True)
class _Data:
    """The data section in file order: each entry, its bytes, and how to wait until they are there."""

    entries: List[framing.Entry]
    views: List[memoryview]
    wait: Callable[[str], None]


def _digests(algorithm: str, data: _Data) -> Dict[str, str]:
    if data.entries:  # hash once the snapshot is complete: hashing would compete with its copy for the CPU
        data.wait(data.entries[-1].name)
    out = {}
    for e, view in zip(data.entries, data.views, strict=True):
        data.wait(e.name)
        out[e.name] = integrity.digest(algorithm, view)
    return out


def _write_hashing_during_flush(
    f: BinaryIO, header: Callable[[Dict[str, str]], bytes], data: _Data, algorithm: str
) -> None:
    """Write the data after a placeholder header while a thread hashes it, then the real header.

    Hashing costs about as much as copying into the page cache; both release the GIL, so they overlap.
    Tensors go straight from their memory to the file descriptor (``os.pwrite``, no buffered-writer
    copy), and writeback of each written stretch starts at once, so the caller's single fsync waits
    only for the tail. Digests are fixed-length hex, so the real header, written last at offset 0,
    has exactly the placeholder's size; nothing is durable or visible before that fsync and the rename.
    """
    hasher = Background(_digests, algorithm, data)
    blank = "0" * len(integrity.digest(algorithm, b""))
    placeholder = header(defaultdict(lambda: blank))
    fd = f.fileno()
    try:
        writeback = Writeback(fd, len(placeholder))
        offset = len(placeholder)
        for e, view in zip(data.entries, data.views, strict=True):
            data.wait(e.name)
            offset = pwrite_all(fd, view, offset)
            writeback.written(offset)
    finally:
        hasher.join()  # on a write error too: the hasher reads memory the caller may reuse once we return
    final = header(hasher.result())
    if len(final) != len(placeholder):
        raise RuntimeError("internal error: header length changed between placeholder and final header")
    pwrite_all(fd, memoryview(final), 0)


DIRECT_CHUNK = 32 << 20
"""Bytes per direct write: each goes out as soon as the snapshot copy has passed its end."""


def _write_direct(f: Any, header: Callable[..., bytes], data: _Data, image: memoryview, algorithm: str) -> bool:
    """Write the file with ``O_DIRECT`` from ``image``: the disk reads the staged bytes, the CPU only hashes.

    The header is padded to ``BLOCK`` so the data section starts on a block. Returns ``False``, having
    written nothing, where the filesystem refuses direct I/O (tmpfs, some network filesystems); the
    caller then writes through the page cache. Durability still comes from the caller's fsync.
    """
    blank = "0" * len(integrity.digest(algorithm, b""))
    placeholder = header(defaultdict(lambda: blank), BLOCK)
    fd = f.fileno()
    with _direct(fd) as direct:
        if not direct or not _pwrite_direct(fd, placeholder, 0, probe=True):
            return False
        hasher = Background(_digests, algorithm, data)
        try:
            size = _write_image(fd, len(placeholder), data, image)
        finally:
            hasher.join()
        final = header(hasher.result(), BLOCK)
        if len(final) != len(placeholder):
            raise RuntimeError("internal error: header length changed between placeholder and final header")
        _pwrite_direct(fd, final, 0)
        os.ftruncate(fd, len(placeholder) + size)  # the last block was written whole; cut its padding
    return True


@contextlib.contextmanager
def _direct(fd: int) -> Iterator[bool]:
    """``O_DIRECT`` on the descriptor already open (never a second open by name, which a link swapped in
    meanwhile would redirect), cleared again on exit; yields ``False`` where it cannot be set."""
    flag = getattr(os, "O_DIRECT", 0)  # Linux, FreeBSD; absent on macOS and Windows
    if not flag:
        yield False
        return
    before = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, before | flag)
    except OSError:
        yield False
        return
    try:
        yield True
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, before)


def _write_image(fd: int, start: int, data: _Data, image: memoryview) -> int:
    """Write the data section from ``image`` in whole blocks at ``start``, each chunk once it is copied."""
    ends = [(e.end, e.name) for e in data.entries if e.end > e.begin]
    size = ends[-1][0] if ends else 0
    for a in range(0, size, DIRECT_CHUNK):
        b = min(a + DIRECT_CHUNK, size)
        data.wait(ends[bisect.bisect_left(ends, (b, ""))][1])  # the tensor holding byte b-1, and all before it
        pwrite_all(fd, image[a : -(-b // BLOCK) * BLOCK], start + a)
    return size


def _pwrite_direct(fd: int, payload: bytes, offset: int, probe: bool = False) -> bool:
    """Write ``payload`` (length a multiple of ``BLOCK``) from a page-aligned copy; ``False`` if a probe is refused."""
    buf = mmap_module.mmap(-1, len(payload))  # freed with its last view (closing it here could fail on one)
    buf[:] = payload
    try:
        pwrite_all(fd, memoryview(buf), offset)
    except OSError as err:
        if probe and err.errno == errno.EINVAL:
            return False
        raise
    return True


def pwrite_all(fd: int, view: memoryview, offset: int) -> int:
    """Write all of ``view`` at ``offset`` in chunks (short writes retried); the offset after it."""
    done, n = 0, len(view)
    while done < n:
        done += os.pwrite(fd, view[done : done + WRITE_CHUNK], offset + done)
    return offset + n


WRITE_CHUNK = 64 << 20
"""Largest single ``pwrite``: big enough to amortise the syscall, small enough to start writeback early."""

WRITEBACK_EVERY = 32 << 20
"""Bytes written between two requests to start writeback (``sync_file_range``)."""


class Writeback:
    """Pace a page-cache write: start writeback of each ``WRITEBACK_EVERY`` stretch as soon as it is
    written, and wait for the stretch before it to reach the disk before writing on.

    The file then has at most about two stretches of dirty pages at a time, instead of up to the
    kernel's dirty limit (a large share of memory): the writer cannot push the whole system into dirty
    throttling, which would stall every other writer, training's logs included, and the final fsync
    waits only for the last stretch. The pace is the disk's own; the CPU does not wait for it.
    """

    def __init__(self, fd: int, start: int) -> None:
        self._fd, self._start = fd, start
        self._previous: Optional[Tuple[int, int]] = None

    def written(self, end: int) -> None:
        if end - self._start < WRITEBACK_EVERY:
            return
        start_writeback(self._fd, self._start, end - self._start)
        if self._previous is not None:
            wait_for_writeback(self._fd, *self._previous)
        self._previous = (self._start, end - self._start)
        self._start = end


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to begin writing ``[offset, offset+nbytes)`` of ``fd`` to disk, without waiting.

    Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` through libc (Python's ``os`` lacks it); a no-op
    where it is unavailable. It only starts I/O: durability still comes from the fsync that follows.
    """
    _sync_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def wait_for_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Wait until ``[offset, offset+nbytes)`` of ``fd`` has been written to disk (data only, not metadata:
    not durability, which still comes from fsync). A no-op where ``sync_file_range`` is unavailable."""
    _sync_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER)


def _sync_range(fd: int, offset: int, nbytes: int, flags: int) -> None:
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, ctypes.c_int64(offset), ctypes.c_int64(nbytes), flags)


_SYNC_FILE_RANGE_WAIT_BEFORE = 1
_SYNC_FILE_RANGE_WAIT_AFTER = 4
_SYNC_FILE_RANGE_WRITE = 2


@functools.lru_cache(maxsize=1)
def _sync_file_range() -> Optional[Callable[..., int]]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn
