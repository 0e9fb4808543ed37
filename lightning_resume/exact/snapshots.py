"""Where a scheduled snapshot goes, and how the previous one makes way.

Through the run's ``RetentionCheckpoint`` when it takes snapshots (a rolling checkpoint it names,
counts and prunes); otherwise beside the first ``ModelCheckpoint``'s files as
``last-snapshot-step=N.ckpt``, outside its top-k bookkeeping. Such a file records inside it that it was
written as that snapshot (``SNAPSHOT_KEY``), and only files that prove it are ever removed: the previous
snapshot once the new one is durable, and at a clean end of training every snapshot a newer verified
checkpoint of the user's callbacks supersedes, so the directory holds what it would hold without
ExactResume (unless a snapshot is the newest state there). Knows Lightning's checkpoint callbacks and the
strategy's file operations, not its loops.
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn

from lightning_resume import collective
from lightning_resume._compat import lightning as lc
from lightning_resume.errors import ConfigurationError, ExactResumeWarning
from lightning_resume.exact.capture import sharded
from lightning_resume.format.atomic import (
    atomic_write,
    fsync_directory,
    fsync_file_and_dir,
    temp_name,
)
from lightning_resume.io.resolve import header_value
from lightning_resume.io.verify import precheck, problem
from lightning_resume.protocols import AsyncCheckpointWriter, SnapshotTarget, StagingCheckpointIO
from lightning_resume.storage import files as storage

SNAPSHOT_PREFIX = "last-snapshot-step="
SNAPSHOT_KEY = "lightning_resume_snapshot"
"""Top-level checkpoint key of a snapshot written beside a ``ModelCheckpoint``: ``{"name": <its file name>}``,
the proof that ExactResume wrote this file as this snapshot (Lightning ignores keys it does not know)."""


def wait_for_previous_write(trainer: pl.Trainer) -> None:
    """Before a durable save's snapshot, every rank waits until rank 0's previous background write is done (its
    staging memory is reused), outside any collective (``collective.wait_for_rank_zero``). Otherwise only rank 0
    waits, inside its save, while the others sit in the next collective (the barrier after the save, the next
    gradient all-reduce) under the process group's timeout, which a write slower than it ends (NCCL's watchdog).
    Replicated strategies only: a sharded one writes its own shards on every rank."""
    writer = trainer.strategy.checkpoint_io
    if trainer.world_size <= 1 or not isinstance(writer, AsyncCheckpointWriter) or sharded(trainer):
        return
    collective.wait_for_rank_zero_writes(writer, "the end of rank 0's previous checkpoint write")


def snapshot_target(trainer: pl.Trainer) -> Optional[SnapshotTarget]:
    """The callback that takes scheduled snapshots itself (a ``RetentionCheckpoint`` with a rule)."""
    # Trainer.callbacks is public but assigned by Lightning's CallbackConnector, so Trainer's types do not declare it
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    targets = (cb for cb in callbacks if isinstance(cb, SnapshotTarget) and cb.accepts_snapshots)
    return next(targets, None)


def first_model_checkpoint(trainer: pl.Trainer) -> Optional[ModelCheckpoint]:
    return next((cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)), None)


def snapshot_dir(trainer: pl.Trainer) -> Optional[str]:
    target = snapshot_target(trainer) or first_model_checkpoint(trainer)
    dirpath = getattr(target, "dirpath", None)
    return None if dirpath is None else str(dirpath)


def save_snapshot(trainer: pl.Trainer, reason: str) -> str:
    """Through the run's RetentionCheckpoint when there is one (a rolling checkpoint), else beside the
    first ModelCheckpoint's files as ``last-snapshot-step=N.ckpt``, which ``ckpt_path="last"`` finds
    (model_checkpoint.py:867-877) and its top-k bookkeeping never sees. The previous such snapshot is
    removed only after the new one is written."""
    target = snapshot_target(trainer)
    if target is not None:
        return target.save_snapshot(trainer, reason)
    dirpath = snapshot_dir(trainer)
    if dirpath is None:
        raise ConfigurationError(
            "ExactResume",
            ["scheduled snapshots need a checkpoint directory; add a RetentionCheckpoint or ModelCheckpoint"],
        )
    path = storage.join(dirpath, f"{SNAPSHOT_PREFIX}{trainer.global_step:09d}.ckpt")
    checkpoint = lc.dump_checkpoint(trainer)  # what trainer.save_checkpoint writes (trainer.py:1463-1465)
    checkpoint[SNAPSHOT_KEY] = {"name": storage.basename(path)}
    trainer.strategy.save_checkpoint(checkpoint, path)
    trainer.strategy.barrier("ExactResume.save_snapshot")
    if trainer.is_global_zero:
        fsync_file_and_dir(path)  # durable before the older snapshot goes (a no-op for remote paths)
        for old in older_snapshots(dirpath, trainer.global_step):
            if written_as_snapshot(old):
                trainer.strategy.remove_checkpoint(old)
    return path


def older_snapshots(dirpath: str, step: int) -> list[str]:
    """This directory's ``last-snapshot-step=N.ckpt`` with N < ``step``: superseded by the new one."""
    found = []
    for entry in storage.list_dir(dirpath):  # URLs keep their scheme (s3fs lists scheme-less keys)
        snapshot_step = step_of_snapshot(entry.name)
        if snapshot_step is not None and snapshot_step < step:
            found.append(entry.path)
    return found


def step_of_snapshot(name: str) -> Optional[int]:
    """N of a ``last-snapshot-step=N.ckpt`` name, else ``None``."""
    digits = name[len(SNAPSHOT_PREFIX) : -len(".ckpt")]
    return int(digits) if name.startswith(SNAPSHOT_PREFIX) and name.endswith(".ckpt") and digits.isdigit() else None


def written_as_snapshot(path: str) -> bool:
    """Whether ``path`` records that ExactResume wrote it as the snapshot of that name (``SNAPSHOT_KEY``). Read
    without running code and without reading tensors (the header of our format, a ``torch.save`` pickle with its
    tensors mapped: ``io.resolve.header_value``; remotely, a ranged read of the header, not the whole file); any
    file that cannot be read so, or lacks the record (a user's file, a snapshot of a version before the record),
    is not ours to delete."""
    try:
        if storage.is_dir(path):
            from lightning_resume.sharded.api import load_meta  # DCP is imported only for sharded runs

            record = (load_meta(path) or {}).get(SNAPSHOT_KEY)
            name = record.get("name") if isinstance(record, dict) else None
        else:
            name = header_value(path, (SNAPSHOT_KEY, "name"))
    except Exception:  # noqa: BLE001 - an unreadable file is simply not proven ours
        return False
    return isinstance(name, str) and name == storage.basename(path)


def remove_superseded(trainer: pl.Trainer) -> list[str]:
    """At a clean end of training, on rank 0: remove each snapshot beside the ``ModelCheckpoint`` files that a
    newer or equal checkpoint of a user's ``ModelCheckpoint``, written in this fit, durable and verified,
    supersedes, and that proves it was written as that snapshot. The newest state in the directory always
    stays (a snapshot no user checkpoint caught up with, e.g. after a preemption stop). Snapshots through a
    ``RetentionCheckpoint`` are its own files, kept or pruned by its rules. Returns the paths removed."""
    dirpath = snapshot_dir(trainer)
    if snapshot_target(trainer) is not None or dirpath is None or not trainer.is_global_zero:
        return []
    ours = {path: storage.basename(path) for path in older_snapshots(dirpath, trainer.global_step + 1)}
    newest = _newest_user_checkpoint(trainer) if ours else None
    if newest is None:
        return []
    user_path, user_step = newest
    writer = async_writer(trainer)
    if writer is not None and not writer.wait(user_path, timeout=writer.flush_timeout):
        return []  # not durable yet: the snapshot stays the newest proven state
    if problem(user_path, check=precheck) is not None:
        return []
    removed = []
    for path, name in ours.items():
        if (step_of_snapshot(name) or 0) <= user_step and written_as_snapshot(path):
            trainer.strategy.remove_checkpoint(path)
            removed.append(path)
    return removed


def _newest_user_checkpoint(trainer: pl.Trainer) -> Optional[tuple[str, int]]:
    """``(path, step)`` of the newest checkpoint a user's ``ModelCheckpoint`` wrote in this fit (``None``: none)."""
    saved = []
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            path = lc.last_checkpoint_saved(callback)
            if path and storage.exists(path):
                saved.append((lc.last_global_step_saved(callback), path))
    if not saved:
        return None
    step, path = max(saved)
    return path, step


def snapshot_files(trainer: pl.Trainer) -> list[str]:
    """Names of the snapshots beside the ``ModelCheckpoint`` files: each exists only because the clock chose
    its step (``prove`` compares them by content where both runs have one, never by presence)."""
    dirpath = None if snapshot_target(trainer) is not None else snapshot_dir(trainer)
    if dirpath is None or not storage.exists(dirpath):
        return []
    return [e.name for e in storage.list_dir(dirpath) if step_of_snapshot(e.name) is not None]


def retention_files(trainer: pl.Trainer) -> list[str]:
    """Names in the directory of the ``RetentionCheckpoint`` that takes the snapshots: which of them stay
    depends on the snapshots' steps once any was taken (its keep rules count them)."""
    target = snapshot_target(trainer)
    dirpath = getattr(target, "dirpath", None)
    if dirpath is None or not storage.exists(str(dirpath)):
        return []
    return [e.name for e in storage.list_dir(str(dirpath)) if not e.name.startswith(".")]


def async_writer(trainer: pl.Trainer) -> Optional[AsyncCheckpointWriter]:
    io = trainer.strategy.checkpoint_io
    return io if isinstance(io, AsyncCheckpointWriter) else None


RESERVE_SLACK = 1.01, 16 << 20
"""Staging reserved ahead: the model's and optimizers' tensors times 1.01, plus 16 MiB for the rest of the
checkpoint (loop and callback state, RNG streams, fingerprints)."""


def reserve_staging(trainer: pl.Trainer) -> Optional[int]:
    """Have an async ``CheckpointIO`` prepare its staging memory for this run's checkpoints now (called once
    the optimizer state exists, after the first step), so the first save does not pay the page faults of
    fresh memory on the training thread. Only the rank that writes the trainer's checkpoints, and only when
    a checkpoint callback will write one; returns the bytes reserved, or ``None``."""
    io = trainer.strategy.checkpoint_io
    writes = trainer.is_global_zero and (snapshot_target(trainer) or first_model_checkpoint(trainer))
    if not writes or not isinstance(io, StagingCheckpointIO):
        return None
    module = trainer.lightning_module
    tensors = [t for t in module.state_dict().values() if isinstance(t, torch.Tensor)]
    for optimizer in trainer.optimizers:
        tensors += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    factor, extra = RESERVE_SLACK
    nbytes = int(sum(t.numel() * t.element_size() for t in tensors) * factor) + extra
    io.reserve(nbytes, pinned=any(t.is_cuda for t in tensors))
    return nbytes


def wait_durable(writer: AsyncCheckpointWriter, path: str) -> None:
    """Before a preemption stop: the snapshot must be on disk, within the writer's ``flush_timeout``."""
    if not writer.wait(None, timeout=writer.flush_timeout):
        rank_zero_warn(
            f"ExactResume: snapshot {path} was not durable within {writer.flush_timeout}s of the preemption signal",
            category=ExactResumeWarning,
        )


def publish_as_hpc(path: str, hpc_path: str) -> None:
    """Make the durable snapshot ``path`` also Lightning's ``hpc_ckpt_N.ckpt`` at ``hpc_path``, so a requeued
    SLURM job resumes from it whether its script passes ``ckpt_path="last"`` or ``None`` (Lightning's hpc
    resolution). Hard links where it can (instant whatever the size: this runs inside the preemption
    notice), else copies; committed by one rename. Rank 0 only, before the job is requeued."""
    if not (storage.is_local(str(path)) and storage.is_local(hpc_path)):
        with storage.open_read(str(path)) as reader:
            atomic_write(hpc_path, lambda target: shutil.copyfileobj(reader, target, 16 << 20))
        return
    source, target = storage.local_path(str(path)), storage.local_path(hpc_path)
    parent = os.path.dirname(os.path.abspath(target))
    staging = os.path.join(parent, temp_name(os.path.basename(target)))
    if os.path.isdir(source):  # a sharded checkpoint directory
        shutil.copytree(source, staging, copy_function=_link_or_copy)
    else:
        _link_or_copy(source, staging)
    os.rename(staging, target)
    fsync_directory(parent)


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another filesystem, or one without hard links
        shutil.copy2(source, target)
        fsync_file_and_dir(target)
