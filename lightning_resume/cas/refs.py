"""The references a content-addressed checkpoint holds and the packs they name, read from headers alone.

``read_refs`` and ``packs_of`` read a checkpoint's header (two ranged reads remotely, no tensor bytes) and check its
refs record against its integrity record (``format.packs.parse_refs``); ``read_pack_header`` reads a pack's. A
malformed record is a ``CheckpointCorruptError`` naming the file. Resolving the references into tensors is the
reader's (``format.read``); deciding what to reference is ``cas.plan``'s.
"""

from __future__ import annotations

from typing import Set

from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.format import integrity
from lightning_resume.format.framing import INTEGRITY_KEY
from lightning_resume.format.packs import NO_REFS, REFS_KEY, PackInfo, Ref, Refs, parse_pack, parse_refs
from lightning_resume.format.read import read_header

__all__ = ["PackInfo", "Ref", "Refs", "packs_of", "read_pack_header", "read_refs"]


def read_refs(path: str) -> Refs:
    """The refs record of the checkpoint ``path`` (``Refs("", {})`` for a file without one, a ``dedupe=False``
    or older file); ``CheckpointCorruptError`` naming the file for a malformed record."""
    header, _ = read_header(str(path))
    if REFS_KEY not in header.metadata:
        return NO_REFS
    if INTEGRITY_KEY not in header.metadata:
        raise CheckpointCorruptError(str(path), f"refs record without an integrity record ('{INTEGRITY_KEY}')")
    record = integrity.parse_record(str(path), header.metadata[INTEGRITY_KEY])
    return parse_refs(str(path), header, record)


def packs_of(path: str) -> Set[str]:
    """The names of the packs the checkpoint ``path`` references (``layout.pack_path`` gives their paths)."""
    return {r.pack for r in read_refs(path).tensors.values()}


def read_pack_header(pack_path: str) -> PackInfo:
    """The pack record and block sizes of the pack at ``pack_path``; ``CheckpointCorruptError`` naming it."""
    header, _ = read_header(str(pack_path))
    return parse_pack(str(pack_path), header)
