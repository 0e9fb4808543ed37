"""Checkpoint files as retention sees them: names, listing, structural verification, durability.

This module owns the rolling file name (``step=000000123.ckpt``: zero-padded, sortable, one file per
step, never a ``-v1`` suffix), how a directory is listed into candidate files, how a file is checked
without loading it into a model, and the fsync that makes a new file durable before anything is
deleted. It knows files, not Lightning's loops, and decides nothing about what to keep.
"""

from __future__ import annotations

import os
import re
import zipfile
from typing import Any, NamedTuple, Optional

from lightning_resume.errors import LightningResumeError
from lightning_resume.io import files as io_files
from lightning_resume.io.atomic import fsync_directory
from lightning_resume.protocols import VerifyingCheckpointIO

STEP_DIGITS = 9
_ROLLING = re.compile(r"^step=(\d+)(\.[A-Za-z0-9]+)$")


def rolling_name(step: int, extension: str = ".ckpt") -> str:
    """The file name of this callback's checkpoint at ``step``: ``step=000000123.ckpt``."""
    return f"step={step:0{STEP_DIGITS}d}{extension}"


def parse_rolling_name(name: str, extension: str = ".ckpt") -> Optional[int]:
    """The step of a rolling file name, or ``None`` if ``name`` is not one of ours."""
    match = _ROLLING.match(os.path.basename(name))
    if match is None or match.group(2) != extension:
        return None
    return int(match.group(1))


class FileEntry(NamedTuple):
    path: str
    mtime: float


def list_checkpoint_files(dirpath: str, extension: str = ".ckpt") -> list:
    """Checkpoints in ``dirpath`` ending in ``extension``: files, and directories (sharded checkpoints
    written through torch.distributed.checkpoint), oldest modification first."""
    if not os.path.isdir(dirpath):
        return []
    entries = []
    for name in os.listdir(dirpath):
        path = os.path.join(dirpath, name)
        if name.endswith(extension) and (os.path.isfile(path) or os.path.isdir(path)):
            entries.append(FileEntry(os.path.normpath(path), os.path.getmtime(path)))
    return sorted(entries, key=lambda e: (e.mtime, e.path))


def verify_problem(path: str, checkpoint_io: Any = None) -> Optional[str]:
    """``None`` if ``path`` verifies, else what is wrong with it. The content decides how, whatever IO
    wrote it: a directory is a sharded checkpoint (its ``COMMITTED`` marker and digests); a
    safetensors file has its checksums; a ``torch.save`` zip is re-read against the CRC-32 of every
    record. ``checkpoint_io`` verifies anything else if it can (``VerifyingCheckpointIO``). Any error
    a hostile file raises is turned into the reason, never raised: one bad file must not stop the
    search for a good one.
    """
    try:
        return _problem(path, checkpoint_io)
    except LightningResumeError as err:
        return str(err)
    except Exception as err:  # noqa: BLE001 - a crafted file can make any reader fail
        return f"unreadable ({type(err).__name__}: {err})"


def _problem(path: str, checkpoint_io: Any) -> Optional[str]:
    if os.path.isdir(path):
        from lightning_resume.sharded import verify_sharded  # DCP is imported only for sharded runs

        verify_sharded(path)
        return None
    if io_files.is_safetensors(path):
        io_files.verify_file(path)
        return None
    if zipfile.is_zipfile(path):
        return _zip_problem(path)
    if isinstance(checkpoint_io, VerifyingCheckpointIO):
        checkpoint_io.verify_checkpoint(path)
        return None
    io_files.verify_file(path)  # raises CheckpointCorruptError naming the format problem
    return None


def _zip_problem(path: str) -> Optional[str]:
    try:
        if not zipfile.is_zipfile(path):
            return "not a complete torch.save zip archive (truncated or not written by torch.save)"
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as err:
        return f"unreadable zip archive: {err}"
    return None if bad is None else f"record {bad!r} fails its CRC-32 check"


def fsync_file_and_dir(path: str) -> None:
    """Flush ``path`` and its directory entry to stable storage (local files only; no-op otherwise)."""
    if not os.path.isfile(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_directory(os.path.dirname(os.path.abspath(path)))


def read_checkpoint_callback_state(path: str, state_key: Optional[str] = None) -> Optional[dict]:
    """The ``ModelCheckpoint``-family state saved in ``path`` (under ``state_key`` if given, else the
    first one), or ``None`` if it cannot be read safely. Reads any of the formats without running code
    and without reading tensors it does not need (memory-mapped, unverified: the state is advisory).
    """
    try:
        if os.path.isdir(path):
            from lightning_resume.sharded import load_meta

            checkpoint = load_meta(path)
        else:
            checkpoint = io_files.load_file(path, verify=False, lenient=True, mmap=True).checkpoint
    except Exception:  # noqa: BLE001 - any unreadable or unsafe file simply has no usable state
        return None
    callbacks = checkpoint.get("callbacks", {}) if isinstance(checkpoint, dict) else {}
    for key, state in callbacks.items():
        wanted = key == state_key if state_key else str(key).startswith("ModelCheckpoint{")
        if wanted and isinstance(state, dict):
            return state
    return None
