"""Checking a dedupe checkpoint (one with references): its index, the packs it names, every block's digest.

``io.verify`` calls this for a safetensors file whose header has ``lightning_resume.refs``: :func:`verify_dedupe`
(the whole check: the tree, each inline tensor and each referenced block hashed, one at a time, from plain
ranged reads) and :func:`check_packs` (the header-level check "last" resolution runs: the references parse and
each pack exists; with ``entries``, each block is listed in its pack with the right size). Every problem is a
``CheckpointCorruptError`` on the checkpoint naming the tensor, and for a block the pack path and the key.
:func:`tensor_bytes` gives each tensor's verified bytes, for ``lightning-resume consolidate``.

Knows the format (``framing``, ``integrity``, ``refs``, ``layout``) and storage, not Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, Mapping, Optional, Tuple

import torch

from lightning_resume.cas.layout import pack_path
from lightning_resume.cas.refs import Ref, read_refs
from lightning_resume.errors import CheckpointCorruptError, LightningResumeError
from lightning_resume.format import framing, integrity
from lightning_resume.format.codec import decode, parse_tree
from lightning_resume.format.framing import INTEGRITY_KEY, TREE_KEY
from lightning_resume.format.packs import REFS_KEY
from lightning_resume.format.read import read_header
from lightning_resume.storage import files as storage

CHUNK = 4 << 20
"""Bytes read and hashed at a time: one tensor or block is never held whole."""


@dataclass(frozen=True)
class Dedupe:
    """A dedupe checkpoint's header, read once: its inline entries, integrity record, tree and references."""

    path: str
    header: framing.Header
    record: Dict
    tree_json: str
    refs: Dict[str, Ref]
    lineage: str


@dataclass(frozen=True)
class Source:
    """Where one tensor's bytes are: ``path`` (the checkpoint, or a pack) from ``begin`` to ``end``."""

    path: str
    begin: int
    end: int
    digest: str
    where: str


def read_dedupe(path: str) -> Optional[Dedupe]:
    """The header of ``path`` if it is a dedupe checkpoint (``None``: no references, read as today)."""
    header, _ = read_header(str(path))
    if REFS_KEY not in header.metadata:
        return None
    for key in (TREE_KEY, INTEGRITY_KEY):
        if key not in header.metadata:
            raise CheckpointCorruptError(path, f"not a lightning-resume checkpoint: header metadata lacks '{key}'")
    record = integrity.parse_record(path, header.metadata[INTEGRITY_KEY])
    refs = read_refs(str(path))
    d = Dedupe(str(path), header, record, header.metadata[TREE_KEY], dict(refs.tensors), refs.lineage)
    _check_index(d)
    integrity.verify_tree(d.path, record, d.tree_json)
    return d


def _check_index(d: Dedupe) -> None:
    """Every recorded tensor is either in the file or referenced (not both), with the recorded dtype and shape;
    a referenced tensor's key is its recorded digest."""
    recorded = d.record["tensors"]
    inline = d.header.entries
    for name in (inline.keys() | d.refs.keys()) - recorded.keys():
        raise CheckpointCorruptError(d.path, f"tensor '{name}' is in the header but not in the integrity record")
    for name in inline.keys() & d.refs.keys():
        raise CheckpointCorruptError(d.path, f"tensor '{name}' is both in the file and referenced")
    for name, spec in recorded.items():
        if type(spec) is not list or len(spec) != 3:
            raise CheckpointCorruptError(d.path, f"tensor '{name}': integrity record entry malformed")
        got = inline.get(name) or d.refs.get(name)
        if got is None:
            raise CheckpointCorruptError(d.path, f"tensor '{name}' is neither in the file nor referenced")
        if [got.dtype, list(got.shape)] != spec[:2]:
            raise CheckpointCorruptError(
                d.path,
                f"tensor '{name}': dtype or shape differs from the recorded one",
                spec[:2],
                [got.dtype, got.shape],
            )
        ref = d.refs.get(name)
        if ref is not None and (
            ref.dtype not in framing.DTYPES or not all(type(n) is int and n >= 0 for n in ref.shape)
        ):
            raise CheckpointCorruptError(d.path, f"tensor '{name}': unknown dtype or bad shape", None, spec[:2])
        if ref is not None and ref.key != spec[2]:
            raise CheckpointCorruptError(
                d.path, f"tensor '{name}': its key differs from its recorded digest", spec[2], ref.key
            )


def _nbytes(dtype: str, shape: Tuple[int, ...]) -> int:
    n = framing.DTYPES[dtype].itemsize
    for dim in shape:
        n *= dim
    return n


def _block(d: Dedupe, ref: Ref, packs: Dict[str, framing.Header]) -> Source:
    """Where ``ref``'s block is, after checking its pack exists and lists it with the right size."""
    path = pack_path(d.path, ref.pack)
    where = f"tensor '{ref.name}': block {ref.key} in pack {path}"
    if ref.pack not in packs:
        try:
            packs[ref.pack] = read_header(path)[0]
        except FileNotFoundError as err:
            raise CheckpointCorruptError(d.path, f"{where}: the pack does not exist") from err
        except LightningResumeError as err:
            raise CheckpointCorruptError(d.path, f"{where}: the pack is unreadable ({err})") from err
    pack = packs[ref.pack]
    entry = pack.entries.get(ref.key)
    if entry is None:
        raise CheckpointCorruptError(d.path, f"{where}: the pack has no such block")
    if entry.end - entry.begin != _nbytes(ref.dtype, ref.shape):
        raise CheckpointCorruptError(
            d.path, f"{where}: the block's size differs", _nbytes(ref.dtype, ref.shape), entry.end - entry.begin
        )
    return Source(path, pack.data_start + entry.begin, pack.data_start + entry.end, ref.key, where)


def check_packs(path: str, entries: bool = False) -> None:
    """The references of ``path`` parse and each pack exists (``entries``: and lists each block with its size).
    A file without references passes."""
    d = read_dedupe(path)
    if d is None:
        return
    packs: Dict[str, framing.Header] = {}
    for ref in sorted(d.refs.values(), key=lambda r: (r.pack, r.name)):
        if entries:
            _block(d, ref, packs)
        elif ref.pack not in packs and not storage.exists(pack_path(d.path, ref.pack)):
            where = f"tensor '{ref.name}': block {ref.key} in pack {pack_path(d.path, ref.pack)}"
            raise CheckpointCorruptError(d.path, f"{where}: the pack does not exist")


def sources(d: Dedupe) -> Iterator[Tuple[str, Source]]:
    """Each recorded tensor, in record order, and where its bytes are (packs checked as they come)."""
    packs: Dict[str, framing.Header] = {}
    for name, spec in d.record["tensors"].items():
        entry = d.header.entries.get(name)
        if entry is None:
            yield name, _block(d, d.refs[name], packs)
        else:
            start = d.header.data_start
            where = f"tensor '{name}' (data bytes {entry.begin}-{entry.end}, after the header)"
            yield name, Source(d.path, start + entry.begin, start + entry.end, spec[2], where)


def _hashed(d: Dedupe, source: Source, keep: bool) -> Tuple[str, Optional[bytearray]]:
    """The digest of ``source``'s bytes (and, with ``keep``, the bytes), read ``CHUNK`` at a time."""
    h = integrity.hasher(str(d.record["algorithm"]))
    kept = bytearray() if keep else None
    for start in range(source.begin, source.end, CHUNK):
        end = min(start + CHUNK, source.end)
        chunk = storage.read_range(source.path, start, end)
        if len(chunk) != end - start:
            raise CheckpointCorruptError(d.path, f"{source.where}: ends early (truncated?)", end - start, len(chunk))
        h.update(chunk)
        if kept is not None:
            kept += chunk
    return h.hexdigest(), kept


def tensor_bytes(d: Dedupe) -> Iterator[Tuple[str, bytearray]]:
    """Each recorded tensor's bytes, in record order, each checked against its digest."""
    for name, source in sources(d):
        actual, data = _hashed(d, source, keep=True)
        _compare(d, source, actual)
        yield name, data if data is not None else bytearray()


def _compare(d: Dedupe, source: Source, actual: str) -> None:
    if actual != source.digest:
        raise CheckpointCorruptError(d.path, f"{source.where}: checksum mismatch", source.digest, actual)


def verify_dedupe(d: Dedupe) -> None:
    """Everything ``d`` holds: each tensor hashed from the file or its pack, the digest over them, and the tree
    decodes (against stand-ins of each tensor's dtype and shape)."""
    digests = []
    for _, source in sources(d):
        actual, _ = _hashed(d, source, keep=False)
        _compare(d, source, actual)
        digests.append(actual)
    algorithm = str(d.record["algorithm"])
    whole = integrity.digest(algorithm, "".join(digests).encode("ascii"))
    if whole != d.record["data"]:
        raise CheckpointCorruptError(d.path, "whole data-section digest mismatch", d.record["data"], whole)
    decode_tree(d)


def decode_tree(d: Dedupe, tensors: Optional[Mapping[str, torch.Tensor]] = None) -> Dict:
    """The checkpoint's tree with ``tensors`` (default: 1-element stand-ins of each one's dtype and shape)."""
    if tensors is None:
        specs = d.record["tensors"]
        tensors = {n: torch.zeros((), dtype=framing.DTYPES[s[0]]).expand(s[1]) for n, s in specs.items()}
    try:
        tree = decode(parse_tree(d.tree_json), dict(tensors), lenient=True)
    except (ValueError, RecursionError) as err:
        raise CheckpointCorruptError(d.path, f"typed JSON tree is malformed: {err}") from err
    if type(tree) is not dict:
        raise CheckpointCorruptError(d.path, "checkpoint root is not a dict", "dict", type(tree).__name__)
    return tree
