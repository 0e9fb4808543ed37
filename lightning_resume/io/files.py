"""Whole-file save, load and verify of checkpoints: the mechanism under ``SafetensorsCheckpointIO``.

Save: encode the whole tree first (so an unencodable value fails before any file is touched), then,
through ``atomic_write``, write the tensor bytes after a placeholder header while a thread hashes
them, and the real header last; one fsync. Locally the bytes go straight from tensor memory to the
file descriptor, with writeback started as they go; an async snapshot (one block-aligned image of
the data section) is written with direct I/O instead, where the filesystem allows. Load: the content,
not the extension, decides the format (safetensors if a JSON header follows the 8-byte length,
anything else goes to the weights-only ``torch.load`` of ``legacy``); local files are memory-mapped
copy-on-write, so tensors are views of the page cache until Lightning copies them into the model.
This module knows files and tensors, not Lightning's loops.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import functools
import io
import json
import mmap as mmap_module
import os
import queue
import sys
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Dict, List, Optional, Tuple

import fsspec
import torch

from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.io import container, integrity
from lightning_resume.io.atomic import atomic_write, is_local, local_path
from lightning_resume.io.format import TreeFormatError, decode, encode
from lightning_resume.io.legacy import load_legacy

TREE_KEY = "lightning_resume.tree"
INTEGRITY_KEY = "lightning_resume.integrity"
FORMAT_KEY = "format"
FORMAT_VALUE = "pt"  # what the safetensors/transformers tooling expects for torch tensors


@dataclass
class Loaded:
    """A parsed file: the checkpoint tree and, for our format, its header (``None`` for legacy)."""

    checkpoint: Dict[str, Any]
    header: Optional[container.Header]
    size: int


def save_file(checkpoint: Dict[str, Any], path: str, algorithm: str = "crc32") -> None:
    """Encode ``checkpoint`` and commit it atomically at ``path``."""
    tree_json, tensors = encode_tree(checkpoint)  # fails on an unencodable value before any file exists
    commit(path, tree_json, tensors, algorithm)


def encode_tree(checkpoint: Dict[str, Any]) -> Tuple[str, Dict[str, torch.Tensor]]:
    """The typed JSON text of ``checkpoint`` and its tensors by name (the tensors are not copied)."""
    encoded = encode(checkpoint)
    tree_json = json.dumps(encoded.tree, separators=(",", ":"), allow_nan=False, ensure_ascii=True)
    return tree_json, encoded.tensors


def commit(
    path: str,
    tree_json: str,
    tensors: Dict[str, torch.Tensor],
    algorithm: str = "crc32",
    ready: Optional[Callable[[str], None]] = None,
    image: Optional[memoryview] = None,
) -> None:
    """Write an encoded checkpoint (from :func:`encode_tree`) atomically at ``path``, hashing while writing.

    ``ready(name)``, when given, blocks until ``tensors[name]`` holds its bytes (an async snapshot still
    being copied, in file order): each tensor is written and hashed as soon as it is ready.
    ``image``, when given, is the data section as one buffer (the tensors are views of it, back to
    back in file order; start and length multiples of ``BLOCK``): a local file is then written from it
    with direct I/O, no page-cache copy, where the filesystem allows.
    """
    wait = ready if ready is not None else _always_ready
    entries = container.layout(tensors)
    views = [container.host_bytes(tensors[e.name]) for e in entries]  # staged tensors: views, no copy

    def header(digests: Dict[str, str], align: int = 8) -> bytes:
        record = integrity.make_record(algorithm, tree_json, entries, digests)
        meta = {FORMAT_KEY: FORMAT_VALUE, TREE_KEY: tree_json, INTEGRITY_KEY: record}
        return container.header_bytes(entries, meta, align)

    def write(f: BinaryIO) -> None:
        data = _Data(entries, views, wait)
        if not _is_local_file(f):
            f.write(header(_digests(algorithm, data)))
            for view in views:
                f.write(view)
        elif image is None or not _write_direct(f, header, data, image, algorithm):
            _write_hashing_during_flush(f, header, data, algorithm)

    atomic_write(path, write)


def _always_ready(name: str) -> None:
    return None


@dataclass(frozen=True)
class _Data:
    """The data section in file order: each entry, its bytes, and how to wait until they are there."""

    entries: List[container.Entry]
    views: List[memoryview]
    wait: Callable[[str], None]


def _digests(algorithm: str, data: _Data) -> Dict[str, str]:
    if data.entries:  # hash once the snapshot is complete: hashing would compete with its copy for the CPU
        data.wait(data.entries[-1].name)
    out = {}
    for e, view in zip(data.entries, data.views):
        data.wait(e.name)
        out[e.name] = integrity.digest(algorithm, view)
    return out


def _write_hashing_during_flush(f: BinaryIO, header: Callable[[Dict[str, str]], bytes], data: _Data, algorithm: str) -> None:
    """Write the data after a placeholder header while a thread hashes it, then the real header.

    Hashing costs about as much as copying into the page cache; both release the GIL, so they overlap.
    Tensors go straight from their memory to the file descriptor (``os.pwrite``, no buffered-writer
    copy), and writeback of each written stretch starts at once, so the caller's single fsync waits
    only for the tail. Digests are fixed-length hex, so the real header, written last at offset 0,
    has exactly the placeholder's size; nothing is durable or visible before that fsync and the rename.
    """
    hasher = _Background(_digests, algorithm, data)
    blank = "0" * len(integrity.digest(algorithm, b""))
    placeholder = header(defaultdict(lambda: blank))
    fd = f.fileno()
    try:
        writeback = _Writeback(fd, len(placeholder))
        offset = len(placeholder)
        for e, view in zip(data.entries, data.views):
            data.wait(e.name)
            offset = _pwrite_all(fd, view, offset)
            writeback.written(offset)
    finally:
        hasher.join()  # on a write error too: the hasher reads memory the caller may reuse once we return
    final = header(hasher.result())
    if len(final) != len(placeholder):
        raise RuntimeError("internal error: header length changed between placeholder and final header")
    _pwrite_all(fd, memoryview(final), 0)


BLOCK = 4096
"""Direct I/O alignment of memory, file offsets and lengths (a page; a multiple of every disk's logical block)."""

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
    fd = _open_direct(f.name)
    if fd is None:
        return False
    try:
        if not _pwrite_direct(fd, placeholder, 0, probe=True):
            return False
        hasher = _Background(_digests, algorithm, data)
        try:
            size = _write_image(fd, len(placeholder), data, image)
        finally:
            hasher.join()
        final = header(hasher.result(), BLOCK)
        if len(final) != len(placeholder):
            raise RuntimeError("internal error: header length changed between placeholder and final header")
        _pwrite_direct(fd, final, 0)
        os.ftruncate(fd, len(placeholder) + size)  # the last block was written whole; cut its padding
    finally:
        os.close(fd)
    return True


def _open_direct(path: str) -> Optional[int]:
    flag = getattr(os, "O_DIRECT", 0)  # Linux, FreeBSD; absent on macOS and Windows
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:
        return None


def _write_image(fd: int, start: int, data: _Data, image: memoryview) -> int:
    """Write the data section from ``image`` in whole blocks at ``start``, each chunk once it is copied."""
    ends = [(e.end, e.name) for e in data.entries if e.end > e.begin]
    size = ends[-1][0] if ends else 0
    for a in range(0, size, DIRECT_CHUNK):
        b = min(a + DIRECT_CHUNK, size)
        data.wait(ends[bisect.bisect_left(ends, (b, ""))][1])  # the tensor holding byte b-1, and all before it
        _pwrite_all(fd, image[a : -(-b // BLOCK) * BLOCK], start + a)
    return size


def _pwrite_direct(fd: int, payload: bytes, offset: int, probe: bool = False) -> bool:
    """Write ``payload`` (length a multiple of ``BLOCK``) from a page-aligned copy; ``False`` if a probe is refused."""
    buf = mmap_module.mmap(-1, len(payload))  # freed with its last view (closing it here could fail on one)
    buf[:] = payload
    try:
        _pwrite_all(fd, memoryview(buf), offset)
    except OSError as err:
        if probe and err.errno == errno.EINVAL:
            return False
        raise
    return True


def _pwrite_all(fd: int, view: memoryview, offset: int) -> int:
    """Write all of ``view`` at ``offset`` in chunks (short writes retried); the offset after it."""
    done, n = 0, len(view)
    while done < n:
        done += os.pwrite(fd, view[done : done + WRITE_CHUNK], offset + done)
    return offset + n


WRITE_CHUNK = 64 << 20
"""Largest single ``pwrite``: big enough to amortise the syscall, small enough to start writeback early."""

WRITEBACK_EVERY = 32 << 20
"""Bytes written between two requests to start writeback (``sync_file_range``)."""


class _Writeback:
    """Start writeback of each stretch once ``WRITEBACK_EVERY`` bytes were written after it."""

    def __init__(self, fd: int, start: int) -> None:
        self._fd, self._start = fd, start

    def written(self, end: int) -> None:
        if end - self._start >= WRITEBACK_EVERY:
            start_writeback(self._fd, self._start, end - self._start)
            self._start = end


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to begin writing ``[offset, offset+nbytes)`` of ``fd`` to disk, without waiting.

    Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` through libc (Python's ``os`` lacks it); a no-op
    where it is unavailable. It only starts I/O: durability still comes from the fsync that follows.
    """
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, ctypes.c_int64(offset), ctypes.c_int64(nbytes), _SYNC_FILE_RANGE_WRITE)


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


def _is_local_file(f: Any) -> bool:
    try:
        f.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return False
    return f.seekable()


@dataclass(frozen=True)
class ReadOptions:
    """``verify``: hash every tensor. ``map_location``: device for tensors (``None``: CPU).
    ``lenient``: unknown enum classes/converters decode to plain values (inspection tools).
    ``mmap``: return copy-on-write views of the file instead of copies (zero-copy, but the file's
    disk space stays in use while any such tensor lives, e.g. optimizer moments for a whole run)."""

    verify: bool = True
    map_location: Any = None
    lenient: bool = False
    mmap: bool = False


def load_file(path: str, verify: bool = True, map_location: Any = None, lenient: bool = False, mmap: bool = False) -> Loaded:
    """Read a checkpoint file of either format; raise ``CheckpointCorruptError`` naming what is wrong."""
    path, opts = str(path), ReadOptions(verify, map_location, lenient, mmap)
    if is_local(path) and not mmap:
        return _load_local_copy(path, opts)
    buf, size = _map(path)
    if _is_safetensors_head(path, bytes(buf[:9])):
        return _load_safetensors(path, buf, size, opts)
    source = local_path(path) if is_local(path) else io.BytesIO(bytes(buf))
    return Loaded(load_legacy(path, source, map_location), None, size)


def _is_safetensors_head(path: str, head: bytes) -> bool:
    """Decide the format from the first bytes; refuse what is neither ours nor ``torch.save``'s."""
    if len(head) == 9 and head[8:9] == b"{":
        return True
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
        return False
    raise CheckpointCorruptError(path, "not a checkpoint: neither safetensors nor torch.save (zip or pickle)", None, head[:8])


def verify_file(path: str) -> None:
    """Check every checksum and that the whole tree decodes; raise ``CheckpointCorruptError`` if not."""
    load_file(path, verify=True, lenient=True, mmap=True)


def is_safetensors(path: str) -> bool:
    with fsspec.open(str(path), "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{"


def _map(path: str) -> Tuple[Any, int]:
    """The whole file as a buffer: a private (copy-on-write) memory map locally, bytes remotely."""
    if not is_local(path):
        fs, fs_path = fsspec.core.url_to_fs(path)
        with fs.open(fs_path, "rb") as f:
            data = bytearray(f.read())
        return memoryview(data), len(data)
    with open(local_path(path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise CheckpointCorruptError(path, "file is empty", "> 0 bytes", 0)
        return mmap_module.mmap(f.fileno(), 0, access=mmap_module.ACCESS_COPY), size



def _checked_metadata(path: str, header: container.Header) -> Tuple[Dict[str, Any], str]:
    """The integrity record and tree JSON, after the cheap checks (index matches record, tree digest)."""
    for key in (TREE_KEY, INTEGRITY_KEY):
        if key not in header.metadata:
            raise CheckpointCorruptError(path, f"not a lightning-resume checkpoint: header metadata lacks '{key}'")
    record = integrity.parse_record(path, header.metadata[INTEGRITY_KEY])
    integrity.check_index(path, record, header.entries)
    tree_json = header.metadata[TREE_KEY]
    integrity.verify_tree(path, record, tree_json)
    return record, tree_json


def _load_local_copy(path: str, opts: ReadOptions) -> Loaded:
    """Read each tensor straight into its own fresh memory (one copy, no page-cache mapping kept)."""
    with open(local_path(path), "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(9)
        if not _is_safetensors_head(path, head):
            return Loaded(load_legacy(path, local_path(path), opts.map_location), None, size)
        n = container.header_length(path, head, size)
        header = container.parse_header(path, head + _read_exact(path, f, max(n - 1, 0)), size)
        record, tree_json = _checked_metadata(path, header)
        pending: "queue.Queue[Any]" = queue.Queue()
        verify = _Background(integrity.verify_data, path, record, iter(pending.get, None)) if opts.verify else None
        tensors = {}
        try:
            for e in sorted(header.entries.values(), key=lambda e: e.begin):  # entries tile the data in order
                t = torch.empty(e.shape, dtype=container.DTYPES[e.dtype])
                view = container.host_bytes(t)
                if len(view):
                    _read_exact(path, f, len(view), into=view)
                pending.put((e, view))
                tensors[e.name] = t
        finally:
            pending.put(None)
        if verify is not None:
            verify.result()
    device = _device(opts.map_location)
    tensors = tensors if device is None else {k: t.to(device) for k, t in tensors.items()}
    return Loaded(_decode_tree(path, tree_json, tensors, opts.lenient), header, size)


def _read_exact(path: str, f: Any, n: int, into: Any = None) -> Any:
    """Read exactly ``n`` bytes (into ``into`` if given); a short read means the file changed or is truncated."""
    buf = into if into is not None else bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = f.readinto(view[got:])
        if not k:
            raise CheckpointCorruptError(path, "file ended while reading (truncated during the read?)", n, got)
        got += k
    return buf


def _load_safetensors(path: str, buf: Any, size: int, opts: ReadOptions) -> Loaded:
    header = container.parse_header(path, memoryview(buf)[: 8 + container.header_length(path, buf[:8], size)], size)
    record, tree_json = _checked_metadata(path, header)
    ordered = sorted(header.entries.values(), key=lambda e: e.begin)
    data = memoryview(buf)[header.data_start :]
    pairs = [(e, data[e.begin : e.end]) for e in ordered]
    verify = _Background(integrity.verify_data, path, record, pairs) if opts.verify else None
    tensors = {name: _tensor(buf, header.data_start, e, opts) for name, e in header.entries.items()}
    if verify is not None:
        verify.result()  # raises CheckpointCorruptError before anything built from the bytes is returned
    return Loaded(_decode_tree(path, tree_json, tensors, opts.lenient), header, size)


class _Background:
    """Run ``fn(*args)`` on a thread (hashing releases the GIL, so it overlaps with copying tensors)."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self._error: Optional[BaseException] = None
        self._value: Any = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self._thread.start()

    def _run(self, fn: Any, args: Tuple) -> None:
        try:
            self._value = fn(*args)
        except BaseException as err:  # handed to the caller's thread by result()
            self._error = err

    def join(self) -> None:
        self._thread.join()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def _tensor(buf: Any, data_start: int, e: container.Entry, opts: ReadOptions) -> torch.Tensor:
    dtype = container.DTYPES[e.dtype]
    start = data_start + e.begin
    if e.end == e.begin:
        t = torch.empty(e.shape, dtype=dtype)
    elif start % dtype.itemsize:  # a hand-made file may misalign; never hand kernels unaligned memory
        t = torch.frombuffer(buf, dtype=torch.uint8, count=e.end - e.begin, offset=start).clone().view(dtype).reshape(e.shape)
    else:
        t = torch.frombuffer(buf, dtype=dtype, count=(e.end - e.begin) // dtype.itemsize, offset=start).reshape(e.shape)
        t = t if opts.mmap else t.clone()
    device = _device(opts.map_location)
    return t if device is None else t.to(device)


def _device(map_location: Any) -> Optional[torch.device]:
    """``str``/``int``/``torch.device`` move tensors; ``None``, callables and dicts keep them on CPU."""
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if isinstance(map_location, int) and not isinstance(map_location, bool):
        return torch.device("cuda", map_location)
    return None


def _decode_tree(path: str, tree_json: str, tensors: Dict[str, torch.Tensor], lenient: bool) -> Dict[str, Any]:
    try:
        tree = decode(json.loads(tree_json), tensors, lenient=lenient)
    except (ValueError, RecursionError) as err:  # TreeFormatError and json's errors are ValueErrors
        raise CheckpointCorruptError(path, f"typed JSON tree is malformed: {err}") from err
    if type(tree) is not dict:
        raise CheckpointCorruptError(path, "checkpoint root is not a dict", "dict", type(tree).__name__)
    return tree


__all__ = ["Loaded", "TreeFormatError", "commit", "encode_tree", "is_safetensors", "load_file", "save_file", "verify_file"]
