"""Reading a checkpoint file of either format, every checksum verified while the bytes arrive.

The content, not the extension, decides the format: safetensors if a JSON header follows the 8-byte
length, a ``torch.save`` zip or pickle goes to the weights-only loader of ``legacy``, anything else
is refused. Local files are read chunk by chunk into each tensor's fresh memory, each chunk hashed
right after it is read, still in cache (or, with ``mmap=True``, memory-mapped copy-on-write and hashed
from the map by a thread). A remote file is read the same way, through a ``storage.RangedReader``: parallel
ranged GETs kept in flight ahead of the read, each chunk copied into the tensors' own memory (a ``torch.save``
file is read through it by ``torch.load``), so the load holds what it builds plus those chunks, never a copy of the file,
and nothing of the download outlives it. Before any of its data is read, the load is refused (``RemoteLoadMemoryError``) if what it would hold exceeds the memory the host has left or the cap
(``storage.remote_budget`` decides, ``storage.host_memory`` measures). A remote load ends by one deadline
(``ReadOptions.read_deadline``), every GET and every retry included. This module knows files and tensors, not
Lightning.
"""

from __future__ import annotations

import mmap as mmap_module
import os
import stat
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.format import framing, in_place, integrity, packs, referenced
from lightning_resume.format.codec import decode, parse_tree
from lightning_resume.format.framing import INTEGRITY_KEY, TREE_KEY
from lightning_resume.format.legacy import load_legacy
from lightning_resume.storage import files as storage
from lightning_resume.storage import host_memory, remote_budget
from lightning_resume.storage.deadline import DEFAULT_READ_DEADLINE_S, Deadline
from lightning_resume.storage.files import is_local, local_path
from lightning_resume.threads import Background


@dataclass
class Loaded:
    """A parsed file: the checkpoint tree and, for our format, its header (``None`` for legacy). ``in_place``:
    the tree path of each tensor read into a destination the caller offered (``ReadOptions.into``), with the
    file's recorded ``(algorithm, digest)`` of its bytes."""

    checkpoint: Dict[str, Any]
    header: Optional[framing.Header]
    size: int
    in_place: Dict[in_place.TreePath, Tuple[str, str]] = field(default_factory=dict)
    refs: packs.Refs = packs.NO_REFS
    """The tensors read from packs (a content-addressed checkpoint: ``format.packs``); none otherwise."""


@dataclass(frozen=True)
class ReadOptions:
    """``verify``: hash every tensor. ``map_location``: device for tensors (``None``: CPU).
    ``lenient``: unknown enum classes/converters decode to plain values (inspection tools).
    ``mmap``: return copy-on-write views of the file instead of copies (zero-copy, but the file's
    disk space stays in use while any such tensor lives, e.g. optimizer moments for a whole run).
    What ``mmap=True`` guarantees: the bytes were verified when loaded, and writing to a tensor never
    changes the file. It cannot guarantee more: a page not yet written is the file's page, so if another
    process rewrites the file *in place* afterwards the tensors show the new bytes, and if it truncates
    the file, touching them raises SIGBUS. lightning-resume's own saves never do either (they write a new
    file and rename it over the name, so a mapping keeps the old file); use ``mmap=False`` (the default)
    for files something else may rewrite in place.
    ``max_remote_load_bytes``: the most host memory a load from a URL may hold (``None``: no cap; the memory
    the host has left always bounds it); see ``storage.remote_budget``.
    ``into``: tensors the caller already holds, by their place in the checkpoint's tree, to read the file's
    tensors straight into (``format.in_place.plan`` says which fit; the others load into new memory). The loaded
    tree then holds those very tensors. Not with ``mmap`` or a ``map_location`` device other than the CPU;
    a ``torch.save`` file loads as always. If the load fails after a destination was written (a checksum, an
    unknown type in the tree, a remote read cut mid-body), the destinations read before the failure hold the
    file's bytes and the error says how many, of ``into_owner`` (``in_place.overwritten_error``).
    ``weights_only``: a ``torch.save`` file loads weights-only (the default; ``PickledCheckpointError`` names
    what else it needs), or with ``False`` (a file the caller trusts) unpickled in full (``format.legacy``). Our
    format never runs code either way.
    ``read_deadline``: seconds a load from a URL may take, every GET and every retry included
    (``RemoteReadTimeoutError`` then; ``None``: ``storage.deadline.DEFAULT_READ_DEADLINE_S``, 10 minutes)."""

    verify: bool = True
    map_location: Any = None
    lenient: bool = False
    mmap: bool = False
    max_remote_load_bytes: Optional[int] = None
    into: Optional[Mapping[in_place.TreePath, torch.Tensor]] = None
    weights_only: bool = True
    into_owner: str = "its caller"
    read_deadline: Optional[float] = None


def load_file(
    path: str,
    verify: bool = True,
    map_location: Any = None,
    lenient: bool = False,
    mmap: bool = False,
    max_remote_load_bytes: Optional[int] = None,
    into: Optional[Mapping[in_place.TreePath, torch.Tensor]] = None,
    weights_only: bool = True,
    into_owner: str = "its caller",
    read_deadline: Optional[float] = None,
) -> Loaded:
    """Read a checkpoint file of either format; raise ``CheckpointCorruptError`` naming what is wrong, and
    ``RemoteLoadMemoryError`` before downloading a remote file whose load would not fit in memory.
    ``into``, ``weights_only``, ``into_owner``, ``read_deadline``: see ``ReadOptions``."""
    path = str(path)
    opts = ReadOptions(
        verify, map_location, lenient, mmap, max_remote_load_bytes, into, weights_only, into_owner, read_deadline
    )
    check_regular_file(path)
    if not is_local(path):
        return _load_remote(path, opts)
    if not mmap:
        return _load_local_copy(path, opts)
    buf, size = _map(path)
    if _is_safetensors_head(path, bytes(buf[:9])):
        return _load_safetensors(path, buf, size, opts)
    return Loaded(load_legacy(path, local_path(path), map_location, weights_only=weights_only), None, size)


def load_open(path: str, f: Any, verify: bool = True) -> Loaded:
    """:func:`load_file` of a local file the caller already opened (e.g. relative to a checked directory
    descriptor, so no rename of a path component can change what is read); ``path`` names it in errors."""
    st = os.fstat(f.fileno())
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointCorruptError(path, "not a regular file (a FIFO, socket or device?); refused")
    return _load_copy(path, f, st.st_size, ReadOptions(verify))


def check_regular_file(path: str) -> None:
    """A local checkpoint must be a regular file: opening a FIFO named ``*.ckpt`` would wait forever for a
    writer, and a device never ends. Checked with ``stat`` (which never blocks) before anything opens it."""
    if is_local(path):
        mode = os.stat(local_path(str(path))).st_mode
        if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
            raise CheckpointCorruptError(
                str(path), "not a regular file (a FIFO, socket or device?); refused without opening it"
            )


def _is_safetensors_head(path: str, head: bytes) -> bool:
    """Decide the format from the first bytes; refuse what is neither ours nor ``torch.save``'s."""
    if len(head) == 9 and head[8:9] == b"{":
        return True
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
        return False
    raise CheckpointCorruptError(
        path, "not a checkpoint: neither safetensors nor torch.save (zip or pickle)", None, head[:8]
    )


def is_safetensors(path: str) -> bool:
    head = storage.read_range(str(path), 0, 9)
    return len(head) == 9 and head[8:9] == b"{"


@dataclass(frozen=True)
class Summary:
    """What the header of a checkpoint of our format says, once the checks that need no tensor bytes passed."""

    header: framing.Header
    record: Dict[str, Any]
    tree_json: str
    size: int
    refs: packs.Refs = packs.NO_REFS


def read_summary(path: str) -> Summary:
    """The header of a safetensors checkpoint, checked without reading its data: the header is well formed
    and every tensor lies inside the file, the integrity record matches the index, and the non-tensor
    tree matches its digest. Reads only the header (two ranged reads remotely). The tensors' checksums
    are left to the load that reads them (``load_file`` hashes every byte as it arrives) or to
    ``io.verify``. ``CheckpointCorruptError`` for any problem, also for a ``torch.save`` file."""
    path = str(path)
    header, size = read_header(path)
    record, tree_json, refs = _checked_metadata(path, header)
    return Summary(header, record, tree_json, size, refs)


def read_header(path: str, deadline: Optional[Deadline] = None) -> Tuple[framing.Header, int]:
    """The checked safetensors header of ``path`` (a checkpoint or a pack) and the file's size, from two ranged
    reads; ``CheckpointCorruptError`` for a malformed one or a ``torch.save`` file, ``FileNotFoundError``."""
    path = str(path)
    check_regular_file(path)
    size = storage.size(path, deadline)
    if size is None:
        raise FileNotFoundError(f"{path}: no such file")
    head = storage.read_range(path, 0, 9, deadline)
    if not _is_safetensors_head(path, head):
        raise CheckpointCorruptError(path, "not a safetensors checkpoint", "safetensors", "torch.save")
    n = framing.header_length(path, head, size)
    return framing.parse_header(path, head + storage.read_range(path, 9, 8 + n, deadline), size), size


def global_step(summary: Summary) -> Optional[int]:
    """The ``global_step`` Lightning saved at the top of the tree, read from the header alone (``None`` if absent)."""
    try:
        step = parse_tree(summary.tree_json)["v"]["global_step"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    return step if type(step) is int else None


def _map(path: str) -> Tuple[Any, int]:
    """The whole local file as a private (copy-on-write) memory map."""
    with open(local_path(path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise CheckpointCorruptError(path, "file is empty", "> 0 bytes", 0)
        return mmap_module.mmap(f.fileno(), 0, access=mmap_module.ACCESS_COPY), size


def _load_remote(path: str, opts: ReadOptions) -> Loaded:
    """A remote file read as a local one is (each tensor straight into its own memory), through a
    ``storage.RangedReader``: beside what is built, only its chunks of parallel ranged GETs are held. Refused
    first, after reading only its size and its first 9 bytes (the format), if the load would hold more memory
    than ``remote_budget`` allows. Every request ends by the load's one deadline."""
    deadline = Deadline.after(DEFAULT_READ_DEADLINE_S if opts.read_deadline is None else opts.read_deadline)
    size = storage.size(path, deadline)
    if size is None:
        raise FileNotFoundError(f"{path}: no such file")
    if size == 0:
        raise CheckpointCorruptError(path, "file is empty", "> 0 bytes", 0)
    fmt: remote_budget.Format = (
        "safetensors" if _is_safetensors_head(path, storage.read_range(path, 0, 9, deadline)) else "torch.save"
    )
    overhead = storage.reader_overhead(size)
    refused = remote_budget.refusal(path, size, fmt, overhead, opts.max_remote_load_bytes, host_memory.available())
    if refused is not None:
        raise refused

    def fits(referenced: int) -> None:  # the blocks of a content-addressed checkpoint come on top of its file
        again = remote_budget.refusal(
            path, size + referenced, fmt, overhead, opts.max_remote_load_bytes, host_memory.available()
        )
        if again is not None:
            raise again

    with storage.RangedReader(path, size, deadline) as f:
        return _load_copy(path, f, size, opts, budget=fits)


def _checked_metadata(path: str, header: framing.Header) -> Tuple[Dict[str, Any], str, packs.Refs]:
    """The integrity record, tree JSON and refs, after the cheap checks (index and refs match the record, tree
    digest)."""
    for key in (TREE_KEY, INTEGRITY_KEY):
        if key not in header.metadata:
            raise CheckpointCorruptError(path, f"not a lightning-resume checkpoint: header metadata lacks '{key}'")
    record = integrity.parse_record(path, header.metadata[INTEGRITY_KEY])
    refs = packs.parse_refs(path, header, record)
    integrity.check_index(path, record, _indexed(header, refs))
    tree_json = header.metadata[TREE_KEY]
    integrity.verify_tree(path, record, tree_json)
    return record, tree_json, refs


def _indexed(header: framing.Header, refs: packs.Refs) -> Dict[str, framing.Entry]:
    """Every tensor of the checkpoint: those in its data section and the referenced ones."""
    return {**header.entries, **{name: r.entry() for name, r in refs.tensors.items()}}


def _ref_order(record: Mapping[str, Any], refs: packs.Refs) -> List[str]:
    """The referenced tensors in the integrity record's order (they follow the inline ones there)."""
    return [name for name in record["tensors"] if name in refs.tensors]


def _load_local_copy(path: str, opts: ReadOptions) -> Loaded:
    """Read each tensor straight into its own fresh memory (one copy, no page-cache mapping kept)."""
    with open(local_path(path), "rb", buffering=0) as f:
        return _load_copy(path, f, os.fstat(f.fileno()).st_size, opts, local_path(path))


def _load_copy(
    path: str, f: Any, size: int, opts: ReadOptions, legacy_source: Any = None, budget: Any = None
) -> Loaded:
    """From the start of the open file ``f`` of ``size`` bytes: each tensor read into its own fresh memory,
    hashed as it lands; a ``torch.save`` file is handed to ``torch.load`` (as ``legacy_source``, default ``f``).
    ``budget(nbytes)``, when given, raises if the referenced tensors' ``nbytes`` do not fit (a remote load)."""
    head = bytes(_read_exact(path, f, 9))
    if not _is_safetensors_head(path, head):
        f.seek(0)
        source = f if legacy_source is None else legacy_source
        return Loaded(load_legacy(path, source, opts.map_location, weights_only=opts.weights_only), None, size)
    n = framing.header_length(path, head, size)
    header = framing.parse_header(path, head + _read_exact(path, f, max(n - 1, 0)), size)
    record, tree_json, refs = _checked_metadata(path, header)
    if budget is not None and refs.tensors:
        budget(sum(r.nbytes for r in refs.tensors.values()))
    tree, device = _parse_tree(path, tree_json), _device(opts.map_location)
    offered = opts.into if opts.into and (device is None or device.type == "cpu") else {}
    targets = in_place.plan(tree, _indexed(header, refs), offered) if offered else {}
    written: List[str] = []
    try:
        tensors = _read_tensors(path, f, header, record, opts.verify, targets, written, refs, _deadline(opts))
        tensors = tensors if device is None else {k: t.to(device) for k, t in tensors.items()}
        checkpoint = _decode_parsed(path, tree, tensors, opts.lenient)
    except Exception as err:  # any failure, once a destination was written, says so (``in_place.overwritten_error``)
        if not written:
            raise
        raise in_place.overwritten_error(err, path, len(written), opts.into_owner) from err
    filled = {
        where: (str(record["algorithm"]), str(record["tensors"][key][2]))
        for where in offered
        if (key := in_place.tensor_key(tree, where)) in targets
    }
    return Loaded(checkpoint, header, size, filled, refs)


def _deadline(opts: ReadOptions) -> Deadline:
    return Deadline.after(DEFAULT_READ_DEADLINE_S if opts.read_deadline is None else opts.read_deadline)


def verify_local(path: str) -> None:
    """Check every checksum of a local safetensors checkpoint and that its tree decodes, from plain reads.

    Never memory-maps: a file truncated or rewritten in place while it is checked gives a short read or
    a checksum mismatch (``CheckpointCorruptError``), never a SIGBUS. Holds one tensor's bytes at a time;
    the tree is decoded against 1-element stand-ins of the right dtype and shape (registered converters
    run on those, unknown classes decode leniently).
    """
    with open(local_path(path), "rb", buffering=0) as f:
        verify_open(path, f)


def verify_open(path: str, f: Any) -> Dict[str, Any]:
    """:func:`verify_local` of a file open for reading from its start (``path`` names it in messages: e.g. a file
    reached through a directory's descriptor). Returns the checkpoint's tree, each tensor a 1-element stand-in of
    its dtype and shape: the values beside the tensors, read with no tensor's bytes kept."""
    size = os.fstat(f.fileno()).st_size
    head = f.read(9)
    if not _is_safetensors_head(path, head):
        raise CheckpointCorruptError(path, "not a safetensors checkpoint", "safetensors", "torch.save")
    n = framing.header_length(path, head, size)
    header = framing.parse_header(path, head + _read_exact(path, f, max(n - 1, 0)), size)
    record, tree_json, refs = _checked_metadata(path, header)
    ordered = sorted(header.entries.values(), key=lambda e: e.begin)  # entries tile the data in order
    check, scratch = integrity.DataCheck(path, record), memoryview(bytearray(CHUNK))
    for e in ordered:
        _read_tensor(path, f, e, scratch, check, reuse=True)
    referenced.verify_referenced(path, refs, _ref_order(record, refs), check)
    check.finish()
    every = list(_indexed(header, refs).values())
    stand_ins = {e.name: torch.zeros((), dtype=framing.DTYPES[e.dtype]).expand(e.shape) for e in every}
    return _decode_tree(path, tree_json, stand_ins, lenient=True)


CHUNK = 1 << 18
"""Bytes read and hashed at a time: each chunk is hashed right after the read writes it, while it is
still in the core's L2 cache, so verifying adds no second pass over main memory. Hashing inline beat a
hashing thread fed chunk by chunk on this 2-core machine under load (the thread waits for the GIL at
each hand-over; figures in the commit that made this choice)."""


def _read_tensors(
    path: str,
    f: Any,
    header: framing.Header,
    record: Dict[str, Any],
    verify: bool,
    targets: Optional[Mapping[str, torch.Tensor]] = None,
    written: Optional[List[str]] = None,
    refs: packs.Refs = packs.NO_REFS,
    deadline: Optional[Deadline] = None,
) -> Dict[str, torch.Tensor]:
    """Read each tensor into its own fresh memory, or into its destination in ``targets`` (``in_place.plan``),
    hashing each chunk as it lands (with ``verify``), then each referenced one from its pack. Each destination is
    appended to ``written`` as its read begins."""
    check = integrity.DataCheck(path, record) if verify else None
    targets = targets or {}
    tensors: Dict[str, torch.Tensor] = {}
    for e in sorted(header.entries.values(), key=lambda e: e.begin):  # entries tile the data in order
        t = targets.get(e.name)
        if t is None:
            t = torch.empty(e.shape, dtype=framing.DTYPES[e.dtype])
        elif written is not None:
            written.append(e.name)  # overwritten from its first byte on, whatever happens next
        _read_tensor(path, f, e, framing.host_bytes(t), check)
        tensors[e.name] = t
    if refs.tensors:
        order = _ref_order(record, refs)
        tensors.update(referenced.read_referenced(path, refs, order, check, dict(targets or {}), written, deadline))
    if check is not None:
        check.finish()  # raises CheckpointCorruptError before any tensor is handed out
    return tensors


def _read_tensor(
    path: str, f: Any, e: framing.Entry, into: memoryview, check: Optional[integrity.DataCheck], reuse: bool = False
) -> None:
    """Read ``e``'s bytes ``CHUNK`` at a time into ``into`` (or, with ``reuse``, each chunk into the start of
    the same ``CHUNK``-sized scratch), hashing each chunk right after it arrives."""
    size = e.end - e.begin
    for start in range(0, size, CHUNK):
        chunk = into[: min(CHUNK, size - start)] if reuse else into[start : min(start + CHUNK, size)]
        _read_exact(path, f, len(chunk), into=chunk)
        if check is not None:
            check.update(chunk)
    if check is not None:
        check.end_tensor(e)


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
    header = framing.parse_header(path, memoryview(buf)[: 8 + framing.header_length(path, buf[:8], size)], size)
    record, tree_json, refs = _checked_metadata(path, header)
    ordered = sorted(header.entries.values(), key=lambda e: e.begin)
    data = memoryview(buf)[header.data_start :]
    pairs: List[Tuple[framing.Entry, Any]] = [p for e in ordered for p in ((e, data[e.begin : e.end]), (e, None))]
    views = opts.mmap
    tensors = {name: _tensor(buf, header.data_start, e, views, opts) for name, e in header.entries.items()}
    with referenced.Packs(path) as opened:
        for name in _ref_order(record, refs):
            mapped, e = opened.mapped(refs.tensors[name])
            pairs += [(e, memoryview(mapped)[e.begin : e.end]), (e, None)]
            tensors[name] = _tensor(mapped, 0, e, views, opts)
        named = {name: referenced.where(path, r) for name, r in refs.tensors.items()}
        verify = Background(integrity.verify_data, path, record, pairs, named) if opts.verify else None
        if verify is not None:
            verify.result()  # raises CheckpointCorruptError before anything built from the bytes is returned
    return Loaded(_decode_tree(path, tree_json, tensors, opts.lenient), header, size, refs=refs)


def _tensor(buf: Any, data_start: int, e: framing.Entry, views: bool, opts: ReadOptions) -> torch.Tensor:
    dtype = framing.DTYPES[e.dtype]
    start = data_start + e.begin
    if e.end == e.begin:
        t = torch.empty(e.shape, dtype=dtype)
    elif start % dtype.itemsize:  # a hand-made file may misalign; never hand kernels unaligned memory
        t = (
            torch.frombuffer(buf, dtype=torch.uint8, count=e.end - e.begin, offset=start)
            .clone()
            .view(dtype)
            .reshape(e.shape)
        )
    else:
        t = torch.frombuffer(buf, dtype=dtype, count=(e.end - e.begin) // dtype.itemsize, offset=start).reshape(e.shape)
        t = t if views else t.clone()
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
    return _decode_parsed(path, _parse_tree(path, tree_json), tensors, lenient)


def _parse_tree(path: str, tree_json: str) -> Any:
    try:
        return parse_tree(tree_json)
    except (ValueError, RecursionError) as err:  # TreeFormatError and json's errors are ValueErrors
        raise CheckpointCorruptError(path, f"typed JSON tree is malformed: {err}") from err


def _decode_parsed(path: str, parsed: Any, tensors: Dict[str, torch.Tensor], lenient: bool) -> Dict[str, Any]:
    try:
        tree = decode(parsed, tensors, lenient=lenient)
    except (ValueError, RecursionError) as err:  # TreeFormatError and json's errors are ValueErrors
        raise CheckpointCorruptError(path, f"typed JSON tree is malformed: {err}") from err
    if type(tree) is not dict:
        raise CheckpointCorruptError(path, "checkpoint root is not a dict", "dict", type(tree).__name__)
    return tree
