"""Loading a ``torch.distributed.checkpoint`` (DCP) directory without running code from it.

What DCP pickles (torch 2.13, ``torch/distributed/checkpoint``):

1. ``.metadata``: the whole ``Metadata`` object, ``pickle.dump`` in ``FileSystemWriter.finish``
   (filesystem.py:774) and read back with a plain ``pickle.load`` (filesystem.py:930), so a hostile
   file runs any ``__reduce__`` payload. :class:`SafeFileSystemReader` reads it with
   :class:`MetadataUnpickler`, whose ``find_class`` admits only the classes a real metadata file
   names (listed in ``ALLOWED_GLOBALS``); anything else raises ``UnsafeCheckpointError`` before any
   object is built.
2. Every non-tensor value of the state (optimizer ``param_groups``, step counters, ...): ``torch.save``
   into a ``.distcp`` file (default_planner.py:286), read back with ``torch.load(weights_only=False)``
   (default_planner.py:387). :class:`SafeLoadPlanner` reads them with ``weights_only=True``: torch's
   restricted unpickler (containers, numbers, strings, tensors), and turns a refusal into
   ``UnsafeCheckpointError``; the bounds of ``format.legacy`` apply (no compressed record, tree size
   and depth).
3. Tensors: ``torch.save`` per chunk (filesystem.py:346), already read with ``weights_only=True``
   (filesystem.py:899).

4. Where each of those lives: ``Metadata.storage_data`` maps every tensor chunk and value to a
   ``_StorageInfo(relative_path, offset, length)`` that DCP's reader opens unchecked
   (filesystem.py:866-875), so a hostile file could name ``/etc/passwd``, ``../x``, ``/dev/zero`` or a
   FIFO, or declare a tensor far larger than its chunks. :func:`check_storage` admits only references
   to files the commit marker lists (regular files, checked by ``verify_committed``), with byte ranges
   inside them that do not overlap, and tensors whose chunks tile them exactly within those ranges;
   :class:`SafeFileSystemReader` applies it to the metadata it hands DCP, and ``io.verify`` to the
   one it verifies.

This module owns only those readers and checks; it does not decide what to load or where from.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import stat
import zipfile
from typing import IO, Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from typing_extensions import override

from lightning_resume._compat.dcp import FsspecReader, StorageInfo, metadata_path, set_nested
from lightning_resume.errors import CheckpointCorruptError, UnsafeCheckpointError
from lightning_resume.format.legacy import check_tree, check_zip
from lightning_resume.sharded.marker import DCP_METADATA, MARKER, FileDigest, read_marker
from lightning_resume.storage import files as storage

MAX_METADATA_BYTES = 256 << 20
"""Largest ``.metadata`` file read (a real one is a few hundred bytes per tensor chunk). Raise it by
assigning ``lightning_resume.sharded.safe_pickle.MAX_METADATA_BYTES`` before loading."""
MAX_CHUNKS_PER_TENSOR = 16384
"""Most chunks one tensor may be split into (checking that chunks do not overlap is quadratic in it).
Raise it by assigning ``lightning_resume.sharded.safe_pickle.MAX_CHUNKS_PER_TENSOR``."""

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
ALLOWED_GLOBALS = frozenset(
    {
        (_DCP_METADATA, "Metadata"),
        (_DCP_METADATA, "MetadataIndex"),
        (_DCP_METADATA, "StorageMeta"),
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "TensorStorageMetadata"),
        (_DCP_METADATA, "BytesStorageMetadata"),
        (_DCP_METADATA, "ChunkStorageMetadata"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # maps "torch.strided" to the layout object, nothing else
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }
)


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file, refusing every global outside ``ALLOWED_GLOBALS`` and dtypes."""

    def __init__(self, file: IO[bytes], path: str) -> None:
        super().__init__(file)
        self._path = path

    @override
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            self._path, f"DCP metadata names {module}.{name}, which is not a DCP metadata class (a pickle payload?)"
        )


def load_metadata(path: str) -> Metadata:
    """Read a DCP ``.metadata`` file (a local path or a URL) with the allowlist; any malformed content is
    ``UnsafeCheckpointError``."""
    path = str(path)
    if storage.is_local(path):
        with open(storage.local_path(path), "rb") as handle:
            _check_metadata_size(path, os.fstat(handle.fileno()).st_size)
            return _unpickle_metadata(handle, path)
    size = storage.size(path)
    if size is None:
        raise CheckpointCorruptError(path, "DCP metadata is missing")
    _check_metadata_size(path, size)
    return _unpickle_metadata(io.BytesIO(storage.read_range(path, 0, MAX_METADATA_BYTES + 1)), path)


def _check_metadata_size(path: str, size: int) -> None:
    if size > MAX_METADATA_BYTES:
        raise CheckpointCorruptError(
            path,
            "DCP metadata is larger than MAX_METADATA_BYTES (raise lightning_resume.sharded.safe_pickle."
            "MAX_METADATA_BYTES to read it)",
            MAX_METADATA_BYTES,
            size,
        )


def _unpickle_metadata(handle: IO[bytes], path: str) -> Metadata:
    try:
        metadata = MetadataUnpickler(handle, path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # a truncated or garbled pickle: refuse, never half-load
        raise UnsafeCheckpointError(path, f"DCP metadata does not unpickle: {err}") from err
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(path, f"DCP metadata holds a {type(metadata).__name__}, not a Metadata")
    return metadata


def load_checked_metadata(directory: str, files: Optional[Mapping[str, FileDigest]] = None) -> Metadata:
    """The ``.metadata`` in ``directory`` (where a committed checkpoint's files are: ``CommitRecord.location``),
    refused unless :func:`check_storage` accepts it.

    ``files`` is what the commit marker lists (read from the marker in ``directory`` when not given).
    """
    metadata = load_metadata(storage.join(directory, DCP_METADATA))
    check_storage(directory, metadata, read_marker(directory).files if files is None else files)
    return metadata


class _SafeMetadata:
    """``read_metadata`` through :func:`load_metadata` (never ``pickle.load``), handing DCP only metadata whose
    every storage reference :func:`check_storage` accepts against ``files`` (the verified commit marker's)."""

    location: str
    files: Optional[Mapping[str, FileDigest]]
    load_id: Any
    checkpoint_id: Any

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = str(metadata_path(self, kwargs.get("rank")))  # type: ignore[arg-type]  # a FileSystemReader
        metadata = load_metadata(path)
        files = self.files if self.files is not None else read_marker(self.location).files
        check_storage(self.location, metadata, files)
        # getattr: metadata pickled by an older torch may lack the attribute
        storage_meta: Optional[StorageMeta] = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = StorageMeta()
            metadata.storage_meta = storage_meta
        storage_meta.load_id = self.load_id
        storage_meta.checkpoint_id = self.checkpoint_id  # saved as the staging dir: name the real one
        return metadata


class SafeFileSystemReader(_SafeMetadata, FileSystemReader):
    """``FileSystemReader`` (a local directory) with the checked metadata of ``_SafeMetadata``."""

    def __init__(self, path: str, files: Optional[Mapping[str, FileDigest]] = None) -> None:
        super().__init__(path)
        self.location, self.files = str(path), files


class SafeFsspecReader(_SafeMetadata, FsspecReader):
    """DCP's fsspec reader (any URL, scheme kept) with the checked metadata of ``_SafeMetadata``."""

    def __init__(self, path: str, files: Optional[Mapping[str, FileDigest]] = None) -> None:
        super().__init__(path)
        self.location, self.files = str(path), files


def safe_reader(location: str, files: Optional[Mapping[str, FileDigest]] = None) -> FileSystemReader:
    """The pickle-restricted DCP reader for the files at ``location`` (a local directory or a URL)."""
    if storage.is_local(location):
        return SafeFileSystemReader(storage.local_path(location), files)
    return SafeFsspecReader(location, files)


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor values with ``torch.load(weights_only=True)``.

    Mirrors ``DefaultLoadPlanner.load_bytes`` (torch/distributed/checkpoint/default_planner.py:384-392),
    whose only change here is ``weights_only``.
    """

    @override
    def load_bytes(self, read_item: Any, value: Any) -> None:
        fqn = read_item.dest_index.fqn
        where = f"{self._checkpoint_id()} (value {fqn!r})"
        check_zip(where, value)  # no compressed record (a bomb), a bounded pickle
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(self._checkpoint_id(), f"value {fqn!r} needs code to load: {err}") from err
        check_tree(where, obj)  # a pickle-memo DAG or a self-containing list stops here, not in a later walk
        if self.flatten_state_dict:
            set_nested(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj

    def _checkpoint_id(self) -> str:
        meta = getattr(self.metadata, "storage_meta", None)
        return str(getattr(meta, "checkpoint_id", None) or "DCP checkpoint")


# ------------------------------------------------------------------------------ storage references


def check_storage(directory: str, metadata: Metadata, files: Mapping[str, FileDigest]) -> None:
    """Every storage reference names a file the marker lists, inside it, and every tensor is tiled by its chunks.

    ``files`` maps the names the commit marker lists to their size (``verify_committed`` checked each
    is a regular file of that size). Raises ``CheckpointCorruptError`` naming the ``.metadata`` file.
    """
    where = storage.join(directory, DCP_METADATA)
    stored = _typed(where, metadata.storage_data, dict, "storage_data")
    entries = _typed(where, metadata.state_dict_metadata, dict, "state_dict_metadata")
    ranges: Dict[str, List[Tuple[int, int, str]]] = {}
    for index, info in stored.items():
        fqn = _typed(where, getattr(index, "fqn", None), str, "a storage key")
        _typed(where, info, StorageInfo, f"storage of {fqn!r}")
        name, begin, end = _storage_range(where, fqn, info, files)
        ranges.setdefault(name, []).append((begin, end, fqn))
    for name, spans in ranges.items():
        _check_disjoint(where, name, spans)
        _check_uncompressed(where, storage.join(directory, name), spans)
    for fqn, entry in entries.items():
        _typed(where, fqn, str, "a state key")
        if isinstance(entry, TensorStorageMetadata):
            _check_tensor(where, fqn, entry, stored)
        elif isinstance(entry, BytesStorageMetadata):
            if MetadataIndex(fqn) not in stored:
                raise CheckpointCorruptError(where, f"value {fqn!r} has no storage reference")
        else:
            raise CheckpointCorruptError(where, f"entry {fqn!r} is a {type(entry).__name__}, not tensor or bytes")


def _typed(where: str, value: Any, cls: type, what: str) -> Any:
    if not isinstance(value, cls) or isinstance(value, bool):
        raise CheckpointCorruptError(where, f"{what} is a {type(value).__name__}, not a {cls.__name__}")
    return value


def _storage_range(where: str, fqn: str, info: Any, files: Mapping[str, FileDigest]) -> Tuple[str, int, int]:
    """(file, begin, end) of one reference: a listed file (never the marker or the metadata), in bounds."""
    name = info.relative_path
    if type(name) is not str or name in (DCP_METADATA, MARKER) or name not in files or os.path.basename(name) != name:
        raise CheckpointCorruptError(
            where, f"storage of {fqn!r} names {name!r}, which is not a shard file listed in the commit marker"
        )
    offset, length = info.offset, info.length
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        raise CheckpointCorruptError(where, f"storage of {fqn!r}: offset/length are not non-negative ints")
    if offset + length > files[name].size:
        raise CheckpointCorruptError(
            where, f"storage of {fqn!r} runs past the end of {name}", files[name].size, offset + length
        )
    if getattr(info, "transform_descriptors", None):  # our writer never sets one (e.g. a decompressor)
        raise CheckpointCorruptError(where, f"storage of {fqn!r} asks for transforms {info.transform_descriptors!r}")
    return name, offset, offset + length


def _check_disjoint(where: str, name: str, spans: List[Tuple[int, int, str]]) -> None:
    """Two references may not read the same bytes: each stored byte backs at most one chunk."""
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise CheckpointCorruptError(where, f"storage of {a!r} and {b!r} overlap in {name}")


class _Window(io.RawIOBase):
    """The bytes ``[begin, begin + length)`` of a file, as a seekable file of their own; ``pread(n, offset)``
    reads the file (``os.pread`` on a descriptor, or a ranged GET)."""

    def __init__(self, pread: Callable[[int, int], bytes], begin: int, length: int) -> None:
        super().__init__()
        self._pread, self._begin, self._length, self._pos = pread, begin, length, 0

    @override
    def readable(self) -> bool:
        return True

    @override
    def seekable(self) -> bool:
        return True

    @override
    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    @override
    def tell(self) -> int:
        return self._pos

    @override
    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        if n == 0:
            return 0  # at the end: no read (a ranged GET of nothing is an error on S3)
        data = self._pread(n, self._begin + self._pos)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


def _check_uncompressed(where: str, path: str, spans: List[Tuple[int, int, str]]) -> None:
    """Each stored item is a ``torch.save`` zip within the bounds of ``format.legacy.check_zip``: no deflated
    record (torch's reader would inflate a bomb whole), a bounded pickle without hash-flooding numbers."""
    if not storage.is_local(path):  # an object store has no links, FIFOs or devices
        for begin, end, fqn in spans:
            if end - begin <= _WHOLE_ITEM_BYTES:  # one GET for a small item, not one per zip structure
                _check_item(where, fqn, io.BytesIO(storage.read_range(path, begin, end)))
            else:
                ranged = _Window(lambda n, at: storage.read_range(path, at, at + n), begin, end - begin)
                _check_item(where, fqn, io.BufferedReader(ranged, _REMOTE_BUFFER))
        return
    fd = os.open(storage.local_path(path), os.O_RDONLY | os.O_NONBLOCK)  # never blocks, even for a FIFO
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointCorruptError(path, "shard is not a regular file (a link, FIFO or device?)")
        for begin, end, fqn in spans:
            _check_item(where, fqn, io.BufferedReader(_Window(functools.partial(os.pread, fd), begin, end - begin)))
    finally:
        os.close(fd)


_WHOLE_ITEM_BYTES = 1 << 20
_REMOTE_BUFFER = 256 << 10


def _check_item(where: str, fqn: str, item: IO[bytes]) -> None:
    if not zipfile.is_zipfile(item):
        raise CheckpointCorruptError(where, f"storage of {fqn!r} is not a torch.save archive")
    check_zip(f"{where} (storage of {fqn!r})", item)


def _check_tensor(where: str, fqn: str, entry: TensorStorageMetadata, storage: Mapping[Any, Any]) -> None:
    """Chunks lie inside the tensor, do not overlap, cover it exactly, and each fits in its stored bytes."""
    size = _shape(where, f"tensor {fqn!r}", entry.size)
    dtype = getattr(entry.properties, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointCorruptError(where, f"tensor {fqn!r} has no dtype")
    chunks = _typed(where, entry.chunks, list, f"chunks of {fqn!r}")
    if len(chunks) > MAX_CHUNKS_PER_TENSOR:
        raise CheckpointCorruptError(
            where,
            f"tensor {fqn!r} has more chunks than MAX_CHUNKS_PER_TENSOR (raise lightning_resume.sharded."
            "safe_pickle.MAX_CHUNKS_PER_TENSOR to read it)",
            MAX_CHUNKS_PER_TENSOR,
            len(chunks),
        )
    boxes, covered = [], 0
    for i, chunk in enumerate(chunks):
        _typed(where, chunk, ChunkStorageMetadata, f"chunk {i} of {fqn!r}")
        offsets = _shape(where, f"chunk {i} of {fqn!r}", chunk.offsets)
        sizes = _shape(where, f"chunk {i} of {fqn!r}", chunk.sizes)
        if (
            len(offsets) != len(size)
            or len(sizes) != len(size)
            or any(o + s > d for o, s, d in zip(offsets, sizes, size, strict=True))
        ):
            raise CheckpointCorruptError(where, f"chunk {i} of tensor {fqn!r} lies outside its size {list(size)}")
        numel = _product(sizes)
        info = storage.get(MetadataIndex(fqn, torch.Size(offsets), i)) or storage.get(MetadataIndex(fqn, offsets))
        if info is None:
            raise CheckpointCorruptError(where, f"chunk {i} of tensor {fqn!r} has no storage reference")
        if numel * dtype.itemsize > info.length:
            raise CheckpointCorruptError(
                where,
                f"chunk {i} of tensor {fqn!r} is larger than its stored bytes",
                info.length,
                numel * dtype.itemsize,
            )
        covered += numel
        if numel:
            boxes.append((offsets, sizes))
    if covered != _product(size) or _any_overlap(boxes):
        raise CheckpointCorruptError(
            where, f"chunks of tensor {fqn!r} do not tile its size {list(size)} (a size larger than the data?)"
        )


def _shape(where: str, what: str, value: Any) -> Tuple[int, ...]:
    if not isinstance(value, (torch.Size, tuple, list)) or not all(type(d) is int and d >= 0 for d in value):
        raise CheckpointCorruptError(where, f"{what}: shape is not a sequence of non-negative ints")
    return tuple(value)


def _product(dims: Tuple[int, ...]) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def _any_overlap(boxes: List[Tuple[Tuple[int, ...], Tuple[int, ...]]]) -> bool:
    """Whether two boxes share an element; sorted by their first coordinate so disjoint runs stop early."""
    boxes = sorted(boxes)
    for i, (a_off, a_size) in enumerate(boxes):
        for b_off, b_size in boxes[i + 1 :]:
            if a_off and b_off[0] >= a_off[0] + a_size[0]:
                break  # every later box starts at or after this one's end along dimension 0
            if all(
                bo < ao + asz and ao < bo + bsz for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size, strict=True)
            ):
                return True
    return False
