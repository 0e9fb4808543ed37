"""Where a dedupe checkpoint's bytes are, for ``lightning-resume inspect``: its own and those it shares.

A checkpoint's **own** bytes are its file (the inline tensors, the tree) and the blocks no other checkpoint of its
directory references: what removing it frees once the packs are collected. Its **shared** bytes are the blocks
another checkpoint of the directory references too. Read from headers only (the checkpoint's, its packs', and the
other checkpoints' of the directory). Knows files and the format, not Lightning.
"""

from __future__ import annotations

from typing import Any, Dict, Set, Tuple

from lightning_resume.cas.gc import regular_file
from lightning_resume.cas.layout import pack_path
from lightning_resume.cas.refs import read_refs
from lightning_resume.errors import LightningResumeError
from lightning_resume.format.read import is_safetensors
from lightning_resume.storage import files as storage


def usage(path: str) -> Dict[str, Any]:
    """``lineage``, ``file_bytes``, ``referenced`` (tensors, bytes), ``packs`` (paths), ``shared_bytes`` and
    ``own_bytes`` of the dedupe checkpoint ``path`` (``{}`` for a file without references)."""
    refs = read_refs(path)
    if not refs.tensors:
        return {}
    others = _keys_elsewhere(path)
    blocks = {(r.pack, r.key): r.nbytes for r in refs.tensors.values()}  # a block referenced twice counts once
    shared = sum(n for block, n in blocks.items() if block in others)
    file_bytes = int(storage.size(path) or 0)
    return {
        "lineage": refs.lineage,
        "file_bytes": file_bytes,
        "referenced_tensors": len(refs.tensors),
        "referenced_bytes": sum(blocks.values()),
        "packs": sorted({pack_path(path, r.pack) for r in refs.tensors.values()}),
        "shared_bytes": shared,
        "own_bytes": file_bytes + sum(blocks.values()) - shared,
    }


def _keys_elsewhere(path: str) -> Set[Tuple[str, str]]:
    """The blocks (pack, key) the other checkpoints in ``path``'s directory reference (unreadable ones count for none)."""
    directory, name = storage.split(str(path))
    keys: Set[Tuple[str, str]] = set()
    for entry in storage.list_dir(directory):
        if entry.is_dir or entry.name.startswith(".") or entry.name == name or not regular_file(entry.path):
            continue
        try:
            if is_safetensors(entry.path):
                keys |= {(r.pack, r.key) for r in read_refs(entry.path).tensors.values()}
        except (LightningResumeError, OSError, ValueError):
            continue
    return keys
