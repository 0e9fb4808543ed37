"""PROVISIONAL (casgc): where packs live, written from contract43 until branch ``cas`` lands; ``cas``'s wins."""

from __future__ import annotations

from typing import Iterable

from lightning_resume.format.integrity import digest
from lightning_resume.storage import files as storage

BLOCKS = "blocks"
MIN_BLOCK_BYTES = 64 << 10


def blocks_dir(checkpoint_path: str) -> str:
    return storage.join(storage.split(str(checkpoint_path))[0], BLOCKS)


def pack_path(checkpoint_path: str, pack: str) -> str:
    return storage.join(blocks_dir(checkpoint_path), f"{pack}.safetensors")


def pack_name(algorithm: str, keys: Iterable[str]) -> str:
    return f"{algorithm}-{digest(algorithm, ','.join(sorted(keys)).encode('ascii'))}"
