"""Dedupe checkpoints built by hand from the format's own primitives (``framing``, ``integrity``, ``cas.layout``),
as docs/safetensors-io.md describes them: a pack per save under ``<D>/blocks/``, and a checkpoint file that
holds the small tensors and the tree and refers to the large ones. Tests use them where they need a file the
writer would never make (a pack of another lineage, a missing or corrupt block) or a precise layout."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from lightning_resume.cas.layout import BLOCKS, MIN_BLOCK_BYTES, pack_name
from lightning_resume.format import framing, integrity
from lightning_resume.format.atomic import atomic_write
from lightning_resume.format.framing import FORMAT_KEY, FORMAT_VALUE, INTEGRITY_KEY, TREE_KEY
from lightning_resume.format.packs import PACK_KEY, REFS_KEY, Ref, pack_metadata, refs_metadata
from lightning_resume.format.write import encode_tree
from lightning_resume.storage import files as storage
from tests.helpers.models import TinyMLP

ALGORITHM = "xxh3-128"


def _write(path: str, header: bytes, views: list) -> None:
    def write(f: Any) -> None:
        f.write(header)
        for view in views:
            f.write(bytes(view))

    atomic_write(path, write)


def write_pack(directory: str, lineage: str, blocks: Mapping[str, bytes], algorithm: str = ALGORITHM) -> str:
    """Write ``blocks`` (key -> bytes) as one pack of ``lineage`` in ``directory/blocks``; its name."""
    keys = sorted(blocks)
    tensors = {k: torch.frombuffer(bytearray(blocks[k]), dtype=torch.uint8) for k in keys}
    entries = framing.layout(tensors)
    record = integrity.make_record(algorithm, "", entries, {k: k for k in keys})
    meta = {FORMAT_KEY: FORMAT_VALUE, INTEGRITY_KEY: record, PACK_KEY: pack_metadata(algorithm, lineage)}
    name = pack_name(algorithm, keys)
    path = storage.join(storage.join(directory, BLOCKS), f"{name}.safetensors")
    _write(path, framing.header_bytes(entries, meta), [blocks[e.name] for e in entries])
    return name


def write_checkpoint(
    path: str,
    checkpoint: Dict[str, Any],
    lineage: str,
    min_bytes: int = MIN_BLOCK_BYTES,
    algorithm: str = ALGORITHM,
    held: Optional[Dict[str, str]] = None,
) -> Tuple[Optional[str], Dict[str, str]]:
    """Write ``checkpoint`` at ``path`` with every tensor of at least ``min_bytes`` referenced: those whose key
    ``held`` (key -> pack name, updated) maps to a pack reference it, the others go into one new pack of
    ``lineage``, as a save does. Returns the new pack's name (``None``: none written) and the key of each
    referenced tensor by name."""
    tree_json, tensors = encode_tree(checkpoint)
    data = {n: bytes(framing.host_bytes(t)) for n, t in tensors.items()}
    digests = {n: integrity.digest(algorithm, b) for n, b in data.items()}
    referenced = sorted(n for n, b in data.items() if len(b) >= min_bytes)
    inline = {n: t for n, t in tensors.items() if n not in referenced}
    entries = framing.layout(inline)
    directory = storage.split(str(path))[0]
    held = {} if held is None else held
    new = {digests[n]: data[n] for n in referenced if digests[n] not in held}
    pack = write_pack(directory, lineage, new, algorithm) if new else None
    held.update((key, str(pack)) for key in new)
    stand_ins = [
        framing.Entry(n, framing.CODES[tensors[n].dtype], tuple(tensors[n].shape), 0, len(data[n])) for n in referenced
    ]
    record = integrity.make_record(algorithm, tree_json, entries + stand_ins, digests)
    refs = [Ref(n, e.dtype, e.shape, digests[n], held[digests[n]]) for n, e in zip(referenced, stand_ins)]
    meta = {FORMAT_KEY: FORMAT_VALUE, TREE_KEY: tree_json, INTEGRITY_KEY: record}
    meta[REFS_KEY] = refs_metadata(lineage, refs, pack)
    _write(str(path), framing.header_bytes(entries, meta), [data[e.name] for e in entries])
    return pack, {n: digests[n] for n in referenced}


def state(step: int, frozen: int = 0, width: int = 256) -> Dict[str, Any]:
    """A Lightning-shaped checkpoint: a frozen weight (the same for every ``step`` of one ``frozen`` seed, 256 KB
    at the default width), a trained weight that changes with ``step``, and a small bias."""
    frozen_weight = torch.Generator().manual_seed(frozen)
    trained = torch.Generator().manual_seed(1000 + step)
    return {
        "state_dict": {
            "backbone.weight": torch.randn(width, width, generator=frozen_weight),
            "head.weight": torch.randn(width, width, generator=trained),
            "head.bias": torch.full((4,), float(step)),
        },
        "global_step": step,
        "epoch": 0,
    }


class FrozenFirst(TinyMLP):
    """``TinyMLP`` with a frozen first layer (256 KiB: referenced, never written again) and a trained 64 KiB-plus
    second one (and its AdamW moments: written into each save's pack)."""

    def __init__(self) -> None:
        super().__init__(hidden=16640)
        self.net[0].requires_grad_(False)
