"""One verifier for every checkpoint this product reads: a file of either format, or a sharded directory.

``verify(path)`` returns only when everything the checkpoint holds was checked, and raises
``CheckpointCorruptError`` (or ``UnsafeCheckpointError``) naming the file, shard or tensor otherwise:

- a directory is a sharded checkpoint: its ``COMMITTED`` marker, the size and SHA-256 of every file
  the marker lists (each ``.distcp`` shard, DCP's ``.metadata``, the non-sharded ``meta.safetensors``),
  each a regular file, and every storage reference of DCP's ``.metadata`` inside those files;
- a safetensors file: every tensor's checksum, the data-section and tree digests, and the whole tree decodes,
  all from plain reads (never a memory map, so a file truncated meanwhile is an error, not a SIGBUS); a dedupe
  file (one with references, docs/safetensors-io.md) has each referenced block read from its pack and hashed
  the same way (``format.referenced``; errors name the checkpoint, tensor, pack and key);
- a ``torch.save`` zip: the CRC-32 of every record, then a weights-only load (no code runs; an intact file
  that needs pickled objects raises ``PickledCheckpointError`` naming them), or with ``weights_only=False``
  (the user's ``fit(..., weights_only=False)``, the CLI's ``--no-weights-only``) a full unpickle, as the load
  that follows will do;
- anything else: the ``checkpoint_io`` given, if it can verify (``VerifyingCheckpointIO``), else the
  reader's own refusal.

The plugin, ``RetentionCheckpoint``, "last" resolution, sharded runs and every CLI command call this
module; nothing else decides whether a checkpoint is good. Knows files, not Lightning.
"""

from __future__ import annotations

import zipfile
from typing import Any, Callable, Optional

from lightning_resume.cas.check import check_packs
from lightning_resume.errors import CheckpointCorruptError, LightningResumeError
from lightning_resume.format.legacy import is_zip, load_legacy, unsafe_globals
from lightning_resume.format.read import check_regular_file, is_safetensors, load_file, read_summary, verify_local
from lightning_resume.protocols import VerifyingCheckpointIO
from lightning_resume.sharded.verify import verify_directory
from lightning_resume.storage import files as storage
from lightning_resume.storage.files import is_local, local_path


def verify(path: str, checkpoint_io: Any = None, digests: bool = True, weights_only: bool = True) -> None:
    """Return if ``path`` verifies in full; raise ``CheckpointCorruptError`` naming what is wrong otherwise.

    ``digests=False`` checks sharded files by size only (their SHA-256 costs a full read). ``weights_only``:
    how a ``torch.save`` file is loaded (``format.legacy``); the other formats never run code.
    """
    path = str(path)
    check_regular_file(path)  # a FIFO named *.ckpt must not hang "last" or ``verify DIR``
    if storage.is_dir(path):
        verify_directory(path, digests)
    elif is_safetensors(path):
        if is_local(path):
            verify_local(path)  # plain reads: a concurrent truncate is an error, never a SIGBUS
        else:
            load_file(path, verify=True, lenient=True)
    elif is_local(path) and is_zip(path, local_path(path)):
        _verify_zip(path, weights_only)
    elif isinstance(checkpoint_io, VerifyingCheckpointIO):
        checkpoint_io.verify_checkpoint(path)
    else:
        load_file(path, weights_only=weights_only)  # a legacy pickle, or the reader refuses the format


def precheck(path: str, weights_only: bool = True) -> None:
    """The part of :func:`verify` a load that hashes every byte does not repeat: for a file of our format, its
    header, integrity record and tree digest, from the header alone (``read.read_summary``); anything else
    (a ``torch.save`` file, a sharded directory) is verified in full. A dedupe file's packs are checked from their
    headers too: each exists and lists each referenced block, so a missing pack passes a candidate over before
    any load (``cas.check.check_packs``). "Last" resolution checks candidates
    this way when the plugin loading the winner verifies as it reads, so a resume reads each byte once."""
    path = str(path)
    check_regular_file(path)
    if not storage.is_dir(path) and is_safetensors(path):
        check_packs(path, read_summary(path).refs, entries=True)  # a dedupe file: each block listed in its pack
    else:
        verify(path, weights_only=weights_only)


def header_only(path: str, weights_only: bool = True) -> None:
    """What "last" resolution checks of a candidate while a memory tier may supply the resume: the part the
    memory tier reads (the run id and step), nothing more. A file of our format: its header, integrity record
    and tree digest (``read.read_summary``), and for a dedupe file that its references parse and each pack
    exists; a local ``torch.save`` file: its pickle, with the tensors mapped,
    not read; anything else is verified in full. The full check follows, before any load, when the memory tier
    does not supply the resume (``retention.last.confirm_last``)."""
    path = str(path)
    check_regular_file(path)
    if not storage.is_dir(path) and is_safetensors(path):
        check_packs(path, read_summary(path).refs)  # a dedupe file: each pack it references exists
    elif not storage.is_dir(path) and is_local(path) and is_zip(path, local_path(path)):
        load_legacy(path, local_path(path), mmap=True, weights_only=weights_only)
    else:
        verify(path, weights_only=weights_only)


def problem(
    path: str,
    checkpoint_io: Any = None,
    check: Optional[Callable[[str], object]] = None,
    weights_only: bool = True,
) -> Optional[str]:
    """``None`` if ``path`` verifies (with ``check``, default :func:`verify` with ``weights_only``), else what
    is wrong with it, in words. Any error a hostile file raises becomes the reason, never an exception: one bad file must not
    stop a search for a good one."""
    try:
        if check is not None:
            check(path)
        else:
            verify(path, checkpoint_io, weights_only=weights_only)
    except (LightningResumeError, OSError) as err:
        return str(err)
    except Exception as err:  # noqa: BLE001 - a crafted file can make any reader fail
        return f"unreadable ({type(err).__name__}: {err})"
    return None


def _verify_zip(path: str, weights_only: bool = True) -> None:
    try:
        with zipfile.ZipFile(local_path(path)) as archive:
            bad = archive.testzip()
    except (OSError, zipfile.BadZipFile, EOFError, ValueError, RuntimeError, NotImplementedError) as err:
        # RuntimeError: a record flagged encrypted; NotImplementedError: an unknown zip version
        raise CheckpointCorruptError(path, f"unreadable torch.save zip archive: {err}") from err
    if bad is not None:
        raise CheckpointCorruptError(path, f"torch.save record {bad!r} fails its CRC-32 check")
    load_file(path, weights_only=weights_only)  # the pickle: allowlisted classes only, unless the caller trusts it


def pickled_globals(path: str) -> tuple[str, ...]:
    """The globals a local ``torch.save`` file at ``path`` names beyond the weights-only allowlist, read from
    its pickle's opcodes (nothing is built or called): what a load with ``weights_only=False`` would import.
    ``()`` for any other file, or one whose pickle cannot be listed."""
    path = str(path)
    try:
        if not is_local(path) or storage.is_dir(path) or not is_zip(path, local_path(path)):
            return ()
        return tuple(unsafe_globals(local_path(path)))
    except (LightningResumeError, OSError):
        return ()
