"""Writing a pack: the blocks a content-addressed save does not find stored, committed under their content's name.

A pack is our safetensors framing with one ``U8`` entry per block, named by its key (``format.packs``). Blocks
whose key is known (hashed first) and blocks hashed while they are written go into one file: locally a new
temporary in ``blocks/``, the data written after a placeholder header (keys are fixed-length hex, so the real header
has its size) while a thread hashes what is not hashed yet, the header last, fsync, then the rename to
``<alg>-<digest of the sorted keys>.safetensors`` (``atomic.atomic_write_named``). Two tensors of equal bytes are
one block: where the hashing finds such a pair among blocks already written, the pack is written again with each
block once (a rare second pass). Remotely every block is hashed first, then the pack uploaded under its name
(``atomic_upload``). A pack whose name is known before writing and that exists already is not written again (a
save redone after a kill). This module knows files and tensors, not which tensors to store (``cas.plan``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO, Callable, Dict, List, Optional

from lightning_resume.format import framing, integrity, packs
from lightning_resume.format.atomic import atomic_upload, atomic_write_named
from lightning_resume.format.framing import FORMAT_KEY, FORMAT_VALUE, INTEGRITY_KEY
from lightning_resume.format.write import Writeback, pwrite_all
from lightning_resume.storage import files as storage
from lightning_resume.storage import multipart
from lightning_resume.threads import Background


@dataclass(frozen=True)
class Block:
    """One tensor to store: its name in the checkpoint, its bytes, its key if hashed already, its element size."""

    name: str
    view: memoryview
    key: Optional[str]
    itemsize: int


def commit_pack(
    directory: str,
    algorithm: str,
    lineage: str,
    blocks: List[Block],
    ready: Callable[[str], None],
    upload: multipart.UploadOptions = multipart.DEFAULT_UPLOAD,
) -> tuple[str, Dict[str, str]]:
    """Commit ``blocks`` as one pack in ``directory`` (``<D>/blocks``); its name and every block's key by tensor
    name. ``ready(name)`` blocks until a tensor's bytes are there (an async snapshot still being copied)."""
    if storage.is_remote(directory) or all(b.key is not None for b in blocks):
        blocks = _hashed(algorithm, blocks, ready)
        name = packs.pack_name(algorithm, [str(b.key) for b in blocks])
        keys = {b.name: str(b.key) for b in blocks}
        if not storage.exists(storage.join(directory, name + packs.PACK_SUFFIX)):
            _write_known(directory, name, algorithm, lineage, _distinct(blocks), upload)
        return name, keys
    found = {b.name: str(b.key) for b in blocks if b.key is not None}  # equal known blocks are written once
    once = _distinct([b for b in blocks if b.key is not None]) + [b for b in blocks if b.key is None]
    try:
        name = atomic_write_named(
            storage.local_path(directory), lambda f: _write_local(f, algorithm, lineage, once, ready, found)
        )
    except _EqualBlocks:  # two blocks had equal bytes: write it again with each block once (keys all known now)
        again = [Block(b.name, b.view, found[b.name], b.itemsize) for b in blocks]
        return commit_pack(directory, algorithm, lineage, again, ready, upload)
    return name[: -len(packs.PACK_SUFFIX)], found


class _EqualBlocks(Exception):
    """Two blocks written into one pack have the same key: the temporary is dropped and the pack written again."""


def _hashed(algorithm: str, blocks: List[Block], ready: Callable[[str], None]) -> List[Block]:
    out = []
    for b in blocks:
        if b.key is None:
            ready(b.name)
        out.append(b if b.key is not None else Block(b.name, b.view, integrity.digest(algorithm, b.view), b.itemsize))
    return out


def _distinct(blocks: List[Block]) -> List[Block]:
    seen: Dict[str, Block] = {}
    for b in blocks:
        seen.setdefault(str(b.key), b)
    return list(seen.values())


def _ordered(blocks: List[Block]) -> List[Block]:
    """Widest elements first (each block starts aligned to its tensor's element size, for a mapped load), known
    keys before the others, then by key or name: the same save lays out the same file."""
    return sorted(blocks, key=lambda b: (-b.itemsize, b.key is None, b.key or "", b.name))


def _header(algorithm: str, lineage: str, names: List[str], blocks: List[Block]) -> bytes:
    entries, offset = [], 0
    for name, b in zip(names, blocks, strict=True):
        entries.append(framing.Entry(name, "U8", (len(b.view),), offset, offset + len(b.view)))
        offset += len(b.view)
    record = integrity.make_record(algorithm, "", entries, {n: n for n in names})
    meta = {FORMAT_KEY: FORMAT_VALUE, INTEGRITY_KEY: record, packs.PACK_KEY: packs.pack_metadata(algorithm, lineage)}
    return framing.header_bytes(entries, meta)


def _write_local(
    f: BinaryIO, algorithm: str, lineage: str, blocks: List[Block], ready: Callable[[str], None], found: Dict[str, str]
) -> str:
    """Write the pack into ``f``, hashing the blocks without a key on a thread while writing; the file name to
    commit it under; ``_EqualBlocks`` where two blocks turned out equal (``found`` then holds every key)."""
    blocks = _ordered(blocks)
    width = len(integrity.digest(algorithm, b""))
    placeholder = _header(algorithm, lineage, [f"{i:0{width}x}" for i in range(len(blocks))], blocks)
    unknown = [b for b in blocks if b.key is None]
    hasher = Background(lambda: _hashed(algorithm, unknown, ready))
    fd = f.fileno()
    try:
        writeback = Writeback(fd, len(placeholder))
        offset = len(placeholder)
        for b in blocks:
            ready(b.name)
            offset = pwrite_all(fd, b.view, offset)
            writeback.written(offset)
    finally:
        hasher.join()
    keys = {b.name: str(b.key) for b in blocks if b.key is not None}
    keys.update({b.name: str(b.key) for b in hasher.result()})
    found.update(keys)
    names = [keys[b.name] for b in blocks]
    if len(set(names)) != len(names):
        raise _EqualBlocks()
    final = _header(algorithm, lineage, names, blocks)
    if len(final) != len(placeholder):
        raise RuntimeError("internal error: pack header length changed between placeholder and final header")
    pwrite_all(fd, memoryview(final), 0)
    return packs.pack_name(algorithm, names) + packs.PACK_SUFFIX


def _constant(view: memoryview) -> Callable[[], memoryview]:
    return lambda: view


def _write_known(
    directory: str, name: str, algorithm: str, lineage: str, blocks: List[Block], upload: multipart.UploadOptions
) -> None:
    """Write a pack whose blocks all have their keys (hashed first), locally or as an upload."""
    blocks = _ordered(blocks)
    header = _header(algorithm, lineage, [str(b.key) for b in blocks], blocks)
    if storage.is_remote(directory):
        segments = [multipart.Segment(len(header), lambda: header)]
        segments += [multipart.Segment(len(b.view), _constant(b.view)) for b in blocks]
        atomic_upload(storage.join(directory, name + packs.PACK_SUFFIX), segments, upload)
        return

    def write(f: BinaryIO) -> str:
        offset = pwrite_all(f.fileno(), memoryview(header), 0)
        for b in blocks:
            offset = pwrite_all(f.fileno(), b.view, offset)
        return name + packs.PACK_SUFFIX

    atomic_write_named(storage.local_path(directory), write)
