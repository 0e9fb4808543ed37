"""A dedupe checkpoint's references checked from headers, and its tensors read whole for ``consolidate``.

:func:`check_packs` is what "last" resolution checks of a dedupe candidate before any load (``io.verify.precheck``
and ``header_only``): its references parse and each pack exists, and with ``entries`` each pack's header lists the
block with the tensor's size. A candidate whose pack is gone is then passed over before a load begins. The full
check (every block hashed) is the reader's (``format.read.verify_local``, ``format.referenced``).
:func:`tensor_bytes` gives each tensor's bytes, from the file or its pack, checked against the recorded digests
(``lightning-resume consolidate``). Errors are ``CheckpointCorruptError`` on the checkpoint naming the tensor, the
pack and the key (``format.referenced.where``). Knows the format and storage, not Lightning.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

from lightning_resume.cas.layout import pack_path
from lightning_resume.cas.refs import Refs, read_refs
from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.format import integrity
from lightning_resume.format.read import Summary, read_summary
from lightning_resume.format.referenced import Packs, where
from lightning_resume.storage import files as storage

CHUNK = 4 << 20
"""Bytes read and hashed at a time."""


def check_packs(path: str, refs: Optional[Refs] = None, entries: bool = False) -> None:
    """The references of ``path`` (``refs``, if its header was read already) parse and each pack exists
    (``entries``: and its header lists each block with the tensor's size). A file without references passes, with
    no read when ``refs`` is given."""
    refs = read_refs(path) if refs is None else refs
    if entries:
        with Packs(str(path)) as opened:
            for ref in refs.tensors.values():
                opened.entry(ref)
        return
    seen: Dict[str, bool] = {}
    for ref in sorted(refs.tensors.values(), key=lambda r: (r.pack, r.name)):
        if ref.pack not in seen:
            seen[ref.pack] = storage.exists(pack_path(str(path), ref.pack))
        if not seen[ref.pack]:
            raise CheckpointCorruptError(str(path), f"{where(str(path), ref)}: the pack is missing")


def tensor_bytes(path: str) -> Tuple[Summary, Iterator[Tuple[str, bytearray]]]:
    """The checked header of the checkpoint ``path`` and each of its tensors' bytes in record order, each compared
    with its recorded digest as it is read, then the digest over them all with the record's."""
    summary = read_summary(str(path))
    return summary, _tensors(str(path), summary)


def _tensors(path: str, summary: Summary) -> Iterator[Tuple[str, bytearray]]:
    algorithm, record, refs = str(summary.record["algorithm"]), summary.record, summary.refs
    digests: List[str] = []
    with Packs(path) as opened:
        for name, spec in record["tensors"].items():
            inline = summary.header.entries.get(name)
            if inline is not None:
                start, source, what = summary.header.data_start, path, f"tensor '{name}'"
                begin, end = start + inline.begin, start + inline.end
            else:
                block = opened.entry(refs.tensors[name])
                source, what = pack_path(path, refs.tensors[name].pack), where(path, refs.tensors[name])
                begin, end = block.begin, block.end
            data, actual = _read_hashed(path, source, begin, end, algorithm, what)
            if actual != spec[2]:
                raise CheckpointCorruptError(path, f"{what}: checksum mismatch", spec[2], actual)
            digests.append(actual)
            yield name, data
    whole = integrity.digest(algorithm, "".join(digests).encode("ascii"))
    if whole != record["data"]:
        raise CheckpointCorruptError(path, "whole data-section digest mismatch", record["data"], whole)


def _read_hashed(path: str, source: str, begin: int, end: int, algorithm: str, what: str) -> Tuple[bytearray, str]:
    h, data = integrity.hasher(algorithm), bytearray()
    for start in range(begin, end, CHUNK):
        chunk = storage.read_range(source, start, min(start + CHUNK, end))
        if len(chunk) != min(start + CHUNK, end) - start:
            raise CheckpointCorruptError(
                path, f"{what}: ends early (truncated?)", min(start + CHUNK, end) - start, len(chunk)
            )
        h.update(chunk)
        data += chunk
    return data, h.hexdigest()
