"""PROVISIONAL (casgc): reading references and pack headers, from contract43; ``cas``'s version wins at merge."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Dict, Set, Tuple

from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.format import framing
from lightning_resume.format.framing import INTEGRITY_KEY
from lightning_resume.storage import files as storage

REFS_KEY = "lightning_resume.refs"
PACK_KEY = "lightning_resume.pack"


@dataclass(frozen=True)
class Ref:
    name: str
    dtype: str
    shape: Tuple[int, ...]
    key: str
    pack: str


@dataclass(frozen=True)
class Refs:
    lineage: str = ""
    tensors: Dict[str, Ref] = field(default_factory=dict)


@dataclass(frozen=True)
class PackInfo:
    lineage: str
    algorithm: str
    keys: Dict[str, int]


def read_header(path: str) -> framing.Header:
    size = storage.size(path)
    if size is None:
        raise FileNotFoundError(f"{path}: no such file")
    head = storage.read_range(path, 0, 8)
    n = framing.header_length(path, head, size)
    return framing.parse_header(path, head + storage.read_range(path, 8, 8 + n), size)


def read_refs(path: str) -> Refs:
    header = read_header(path)
    text = header.metadata.get(REFS_KEY)
    if text is None:
        return Refs()
    try:
        doc = json.loads(text)
        recorded = json.loads(header.metadata[INTEGRITY_KEY])["tensors"]
        tensors = {}
        for name, (pack, key) in doc["tensors"].items():
            dtype, shape, _ = recorded[name]
            tensors[name] = Ref(name, dtype, tuple(shape), key, pack)
        return Refs(str(doc["lineage"]), tensors)
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointCorruptError(path, f"malformed {REFS_KEY} record: {err}") from err


def packs_of(path: str) -> Set[str]:
    return {r.pack for r in read_refs(path).tensors.values()}


def read_pack_header(pack_path: str) -> PackInfo:
    header = read_header(pack_path)
    try:
        doc = json.loads(header.metadata[PACK_KEY])
        info = PackInfo(str(doc["lineage"]), str(doc["algorithm"]), {})
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointCorruptError(pack_path, f"not a pack: malformed {PACK_KEY} record: {err}") from err
    return PackInfo(info.lineage, info.algorithm, {k: e.end - e.begin for k, e in header.entries.items()})
