"""The content-addressed part of the format: where packs live, how they are named, and the two header records.

A checkpoint saved with ``dedupe=True`` keeps each tensor of at least ``MIN_BLOCK_BYTES`` out of its own data
section and references it instead: the ``lightning_resume.refs`` record in its header maps the tensor's name to
a ``(pack, key)``. A pack is a safetensors file in ``<checkpoint directory>/blocks/``, one ``U8`` entry per block
named by its key (the hex digest of its bytes under the pack's algorithm), its header carrying the
``lightning_resume.pack`` record. The integrity record of the checkpoint still lists every tensor, inline and
referenced, so a referenced tensor's key is its recorded digest (docs/safetensors-io.md, "Content-addressed saves
(dedupe)"). This module holds the names, the records and their checks as pure functions over header text; reading
and writing the bytes is ``read``'s and ``write``'s, deciding what to reference is ``cas.plan``'s. It lives in
``format`` (``cas`` re-exports it) because ``read`` and ``write`` need it and ``cas`` sits above ``format``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

from lightning_resume.errors import CheckpointCorruptError, short_repr
from lightning_resume.format import framing, integrity
from lightning_resume.format.framing import unique_keys
from lightning_resume.storage import files as storage

BLOCKS = "blocks"
"""The folder, beside the checkpoints, that holds the packs."""
MIN_BLOCK_BYTES = 64 << 10
"""Tensors smaller than this stay inline in the checkpoint file: a reference would cost more than it saves."""
REFS_KEY = "lightning_resume.refs"
"""Checkpoint header metadata key of the refs record."""
PACK_KEY = "lightning_resume.pack"
"""Pack header metadata key of the pack record."""
VERSION = 1
"""Version of both records (``refs`` and ``pack``): the format version of content-addressed saves."""
PACK_SUFFIX = ".safetensors"

_PACK = re.compile(r"^(?P<algorithm>[a-z0-9]+(?:-[0-9]+)?)-(?P<digest>[0-9a-f]{8,128})$")
_HEX = re.compile(r"^[0-9a-f]{8,128}$")


def blocks_dir(checkpoint_path: str) -> str:
    """``<D>/blocks`` for a checkpoint ``<D>/<name>.ckpt`` (any fsspec URL, scheme kept)."""
    return storage.join(storage.split(str(checkpoint_path))[0], BLOCKS)


def pack_path(checkpoint_path: str, pack: str) -> str:
    """Where the pack named ``pack`` of the checkpoint at ``checkpoint_path`` lives."""
    return storage.join(blocks_dir(checkpoint_path), pack + PACK_SUFFIX)


def pack_name(algorithm: str, keys: Iterable[str]) -> str:
    """``<alg>-<digest of the sorted keys joined by ",">``: the same blocks always give the same name, so a save
    redone after a kill writes the same pack."""
    return f"{algorithm}-{integrity.digest(algorithm, ','.join(sorted(set(keys))).encode('ascii'))}"


def is_pack_name(name: str) -> bool:
    """Whether ``name`` (without the suffix) is a well-formed pack name: never a path, never hidden."""
    m = _PACK.match(name)
    return m is not None and m.group("algorithm") in integrity.ALGORITHMS


@dataclass(frozen=True)
class Ref:
    """One referenced tensor of a checkpoint: its dtype, shape and key (its recorded digest) and its pack's name."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    key: str
    pack: str

    @property
    def nbytes(self) -> int:
        n = framing.DTYPES[self.dtype].itemsize
        for d in self.shape:
            n *= d
        return n

    def entry(self) -> framing.Entry:
        """A stand-in index entry (offsets ``0..nbytes``: it has no place in the checkpoint's data section)."""
        return framing.Entry(self.name, self.dtype, self.shape, 0, self.nbytes)


@dataclass(frozen=True)
class Refs:
    """A checkpoint's refs record: its lineage and its referenced tensors by name (empty without a record)."""

    lineage: str
    tensors: Dict[str, Ref]
    wrote: Optional[str] = None
    """The pack the save that wrote this checkpoint wrote (``None``: it referenced only older ones)."""


NO_REFS = Refs("", {})


@dataclass(frozen=True)
class PackInfo:
    """A pack's header: its lineage, digest algorithm and blocks (key -> bytes)."""

    lineage: str
    algorithm: str
    keys: Dict[str, int]


def refs_metadata(lineage: str, refs: Iterable[Ref], wrote: Optional[str]) -> str:
    """The refs record's JSON text."""
    tensors = {r.name: [r.pack, r.key] for r in sorted(refs, key=lambda r: r.name)}
    doc = {"version": VERSION, "lineage": lineage, "tensors": tensors, "wrote": wrote}
    return json.dumps(doc, separators=(",", ":"))


def pack_metadata(algorithm: str, lineage: str) -> str:
    """The pack record's JSON text."""
    return json.dumps({"version": VERSION, "algorithm": algorithm, "lineage": lineage}, separators=(",", ":"))


def parse_refs(path: str, header: framing.Header, record: Mapping[str, Any]) -> Refs:
    """The refs record of the checkpoint ``path`` checked against its header and integrity ``record``: every
    referenced tensor is recorded, absent from the data section, and keyed by its recorded digest; ``NO_REFS``
    for a file without one. ``CheckpointCorruptError`` naming the file and the tensor otherwise."""
    text = header.metadata.get(REFS_KEY)
    if text is None:
        return NO_REFS
    doc = _json(path, "refs record", text)
    if doc.get("version") != VERSION:
        raise CheckpointCorruptError(path, "refs record version (written by a newer lightning-resume?)", VERSION,
                                     doc.get("version"))  # fmt: skip
    lineage, tensors, wrote = doc.get("lineage"), doc.get("tensors"), doc.get("wrote")
    if type(lineage) is not str or not _HEX.match(lineage) or type(tensors) is not dict:
        raise CheckpointCorruptError(path, "refs record is missing its lineage or tensors")
    if wrote is not None and (type(wrote) is not str or not is_pack_name(wrote)):
        raise CheckpointCorruptError(path, "refs record: 'wrote' is not a pack name", None, short_repr(wrote))
    refs = {name: _ref(path, name, spec, header, record) for name, spec in tensors.items()}
    return Refs(lineage, refs, wrote)


def _ref(path: str, name: str, spec: Any, header: framing.Header, record: Mapping[str, Any]) -> Ref:
    where = f"tensor '{name}'"
    if type(spec) is not list or len(spec) != 2 or not all(type(s) is str for s in spec):
        raise CheckpointCorruptError(path, f"{where}: refs entry malformed", "[pack, key]", short_repr(spec))
    pack, key = spec
    if not is_pack_name(pack) or not pack.startswith(str(record["algorithm"]) + "-"):
        raise CheckpointCorruptError(
            path, f"{where}: refs entry names no pack of this file's algorithm", record["algorithm"], pack
        )
    if name in header.entries:
        raise CheckpointCorruptError(path, f"{where}: both referenced and in the data section")
    recorded = record["tensors"].get(name)
    if type(recorded) is not list or len(recorded) != 3 or type(recorded[1]) is not list:
        raise CheckpointCorruptError(path, f"{where}: referenced but not in the integrity record")
    dtype, shape, digest = recorded
    if key != digest:
        raise CheckpointCorruptError(path, f"{where}: refs key differs from the recorded digest", digest, key)
    entry = framing.check_spec(path, name, dtype, shape)
    return Ref(name, entry.dtype, entry.shape, key, pack)


def parse_pack(path: str, header: framing.Header) -> PackInfo:
    """The pack record of the pack file ``path`` checked against its header: every entry is a ``U8`` block named
    by a hex key. ``CheckpointCorruptError`` naming the pack otherwise."""
    text = header.metadata.get(PACK_KEY)
    if text is None:
        raise CheckpointCorruptError(path, f"not a pack: header metadata lacks '{PACK_KEY}'")
    doc = _json(path, "pack record", text)
    lineage, algorithm = doc.get("lineage"), doc.get("algorithm")
    if doc.get("version") != VERSION or type(lineage) is not str or algorithm not in integrity.ALGORITHMS:
        raise CheckpointCorruptError(path, "pack record malformed or of a newer version", VERSION, doc.get("version"))
    keys = {}
    for key, e in header.entries.items():
        if e.dtype != "U8" or len(e.shape) != 1 or not _HEX.match(key):
            raise CheckpointCorruptError(path, f"pack entry '{key}' is not a U8 block named by its key")
        keys[key] = e.end - e.begin
    return PackInfo(lineage, str(algorithm), keys)


def _json(path: str, what: str, text: str) -> Dict[str, Any]:
    try:
        doc = json.loads(text, object_pairs_hook=unique_keys)
    except (ValueError, RecursionError) as err:
        raise CheckpointCorruptError(path, f"{what} is not valid JSON") from err
    if type(doc) is not dict:
        raise CheckpointCorruptError(path, f"{what} is not a JSON object")
    return doc
