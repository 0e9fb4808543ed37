"""The safetensors framing: layout, header bytes, and a bounds-checked header parser.

A file is ``<u64 little-endian header length N><N bytes of JSON header><data>``, the layout the
``safetensors`` library reads (tests check it does). We write it ourselves so tensors stream from
their own memory to the file with no intermediate copy, and we parse it ourselves so that every
length, offset, dtype and shape of a hostile file is checked against the real file size before a
single byte is allocated for it. This module knows tensors and bytes, not checkpoints or Lightning.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Tuple, Union

import torch

from lightning_resume.errors import CheckpointCorruptError, TreeFormatError, UnencodableValueError, short_repr

TREE_KEY = "lightning_resume.tree"
"""Header metadata key of the typed JSON tree (everything that is not a tensor)."""
INTEGRITY_KEY = "lightning_resume.integrity"
"""Header metadata key of the integrity record (``integrity.make_record``)."""
FORMAT_KEY = "format"
FORMAT_VALUE = "pt"  # what the safetensors/transformers tooling expects for torch tensors

BLOCK = 4096
"""Direct I/O alignment of memory, file offsets and lengths (a page; a multiple of every disk's logical
block): the data section of an async snapshot starts on one, and its staging pool is laid out in them."""

MAX_HEADER_BYTES = 100_000_000
"""Same cap as the safetensors library: a larger declared header is refused before reading it."""

DTYPES: Dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
}  # fmt: skip
CODES: Dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Entry:
    """One tensor's place in the data section (offsets relative to the data start)."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    entries: Dict[str, Entry]
    metadata: Dict[str, str]
    data_start: int


def check_storable(t: torch.Tensor, path: str) -> None:
    """Raise ``UnencodableValueError`` for tensors safetensors cannot hold."""
    if t.layout != torch.strided or t.is_quantized:
        raise UnencodableValueError(path, f"torch.Tensor[{t.layout}]", "only dense (strided) tensors are stored")
    if t.dtype not in CODES:
        raise UnencodableValueError(path, f"torch.Tensor[{t.dtype}]", f"dtype {t.dtype} has no safetensors code")
    if t.device.type == "meta":
        raise UnencodableValueError(path, "torch.Tensor[meta]", "a meta tensor has no data")


def host_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order, without a copy when it is already a dense CPU tensor."""
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    t = t.cpu().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy().data).cast("B")


def layout(tensors: Mapping[str, torch.Tensor]) -> List[Entry]:
    """Place tensors widest dtype first (so each starts aligned to its element size), then by name."""
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    entries, offset = [], 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        entries.append(Entry(name, CODES[t.dtype], tuple(t.shape), offset, offset + size))
        offset += size
    return entries


def header_bytes(entries: List[Entry], metadata: Mapping[str, str], align: int = 8) -> bytes:
    """``<u64 N><JSON>`` padded with spaces so the data section starts ``align``-byte aligned (8 or a
    multiple of 8: a disk block for direct I/O; JSON allows trailing spaces, as safetensors' own files have)."""
    doc: Dict[str, Any] = {"__metadata__": dict(metadata)}
    for e in entries:
        doc[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    raw += b" " * (-(8 + len(raw)) % align)
    return struct.pack("<Q", len(raw)) + raw


def unique_keys(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    """``object_pairs_hook`` for every JSON this package reads: a key given twice is refused (parsers
    disagree on which one wins, so a file could show one value to a checker and another to a loader)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        for key, _ in pairs:
            if key in seen:
                raise TreeFormatError(f"JSON object has the key {short_repr(key)} more than once")
            seen.add(key)
    return out


def parse_header(path: str, prefix: Union[bytes, bytearray, memoryview], file_size: int) -> Header:
    """Validate the header in ``prefix`` (the file's first bytes) against ``file_size``.

    ``prefix`` must hold at least the first 8 bytes; call :func:`header_length` first to know how
    many bytes to read. Raises ``CheckpointCorruptError`` for every inconsistency.
    """
    n = header_length(path, prefix, file_size)
    try:
        doc = json.loads(bytes(prefix[8 : 8 + n]).decode("utf-8"), object_pairs_hook=unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:  # TreeFormatError (a key twice) is a ValueError
        raise CheckpointCorruptError(path, "header is not valid JSON", "JSON object", str(err)) from err
    if type(doc) is not dict:
        raise CheckpointCorruptError(path, "header is not a JSON object", "object", type(doc).__name__)
    metadata = _metadata(path, doc.pop("__metadata__", {}))
    entries = {name: _entry(path, name, spec) for name, spec in doc.items()}
    _check_coverage(path, entries, file_size - 8 - n)
    return Header(entries, metadata, 8 + n)


def header_length(path: str, prefix: Union[bytes, bytearray, memoryview], file_size: int) -> int:
    if file_size < 8 or len(prefix) < 8:
        raise CheckpointCorruptError(path, "file too short for a safetensors header", ">= 8 bytes", file_size)
    (n,) = struct.unpack("<Q", bytes(prefix[:8]))
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise CheckpointCorruptError(
            path,
            "header length runs past the end of the file (truncated?)",
            f"<= {min(file_size - 8, MAX_HEADER_BYTES)}",
            n,
        )
    return n


def _metadata(path: str, meta: Any) -> Dict[str, str]:
    if type(meta) is not dict or not all(type(k) is str and type(v) is str for k, v in meta.items()):
        raise CheckpointCorruptError(path, "header __metadata__ is not a str->str object")
    return meta


MAX_DIMS = 64  # torch's own limit on tensor dimensions
MAX_DIM = 2**62  # a dimension torch can index; larger ones only come from crafted headers


def _entry(path: str, name: str, spec: Any) -> Entry:
    where = f"tensor '{name}'"
    if type(spec) is not dict or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise CheckpointCorruptError(
            path, f"{where}: header entry malformed", "{dtype, shape, data_offsets}", short_repr(spec)
        )
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    expected = check_spec(path, name, dtype, shape).end
    if type(offsets) is not list or len(offsets) != 2 or not all(type(o) is int and o >= 0 for o in offsets):
        raise CheckpointCorruptError(path, f"{where}: data_offsets malformed", "[begin, end]", short_repr(offsets))
    if offsets[1] - offsets[0] != expected:
        raise CheckpointCorruptError(
            path, f"{where}: byte range does not match dtype {dtype} x shape {shape}", expected, offsets[1] - offsets[0]
        )
    return Entry(name, dtype, tuple(shape), offsets[0], offsets[1])


def check_spec(path: str, name: str, dtype: Any, shape: Any) -> Entry:
    """A tensor's dtype code and shape list, checked; its entry at offsets ``0..nbytes``."""
    where = f"tensor '{name}'"
    if type(dtype) is not str or dtype not in DTYPES:
        raise CheckpointCorruptError(path, f"{where}: unknown dtype", sorted(DTYPES), dtype)
    if type(shape) is not list or len(shape) > MAX_DIMS or not all(type(d) is int and 0 <= d < MAX_DIM for d in shape):
        raise CheckpointCorruptError(
            path, f"{where}: shape is not a list of at most {MAX_DIMS} ints in [0, 2**62)", None, short_repr(shape)
        )
    numel = 1
    for d in shape:
        numel *= d
    return Entry(name, dtype, tuple(shape), 0, numel * DTYPES[dtype].itemsize)


def _check_coverage(path: str, entries: Mapping[str, Entry], data_size: int) -> None:
    """Byte ranges must tile the data section exactly: no overlap, no gap, nothing past the end."""
    cursor = 0
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.begin != cursor:
            what = "overlaps the previous tensor" if e.begin < cursor else "leaves a gap before it"
            raise CheckpointCorruptError(path, f"tensor '{e.name}': byte range {what}", cursor, e.begin)
        if e.end > data_size:
            raise CheckpointCorruptError(
                path, f"tensor '{e.name}': byte range runs past the end of the file (truncated?)", data_size, e.end
            )
        cursor = e.end
    if cursor != data_size:
        raise CheckpointCorruptError(
            path, "data section size differs from the tensors in the header", cursor, data_size
        )
