"""The memory tier: one full checkpoint per rank in shared memory, outliving the process that wrote it.

A process killed by an exception, the OOM killer or a deploy leaves ``/dev/shm`` intact while the node
lives, so a snapshot there costs one copy and loses almost nothing. Each rank's snapshot is one file in
the project's safetensors format (checksummed), written through ``write.commit`` into a temporary and
renamed over the previous one: a reader never sees half a snapshot, and the old one goes only once the
new one is complete. tmpfs has no disk behind it, so its ``fsync`` costs nothing.

Layout: ``<root>/<run key>/rank-<r>-of-<w>.safetensors`` plus ``rank-<r>-of-<w>.owner`` (owner token and
pid, for stale cleanup). The run key hashes the durable checkpoint directory and a run id stored in it
(:func:`run_id`), so a new process finds the snapshot of *its* run and never one of a run whose durable
directory was deleted and started over. The step, save sequence and save time travel inside the file
(``MEMORY_KEY``), committed with it. This module knows files and tensors, not Lightning.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from lightning_resume import storage
from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.io import read, write
from lightning_resume.io.async_save import AsyncSaver, commit_staged
from lightning_resume.io.atomic import (
    STALE_AFTER_S,
    atomic_write,
    owner_token,
    pid_alive,
    read_quietly,
    remove_quietly,
)
from lightning_resume.io.buffers import StagedTensors
from lightning_resume.io.integrity import DEFAULT_ALGORITHM

DEFAULT_ROOT = "/dev/shm/lightning-resume"
"""Where snapshots live unless ``ExactResume(memory_dir=...)`` says otherwise."""

MEMORY_KEY = "lightning_resume_memory_tier"
"""Key of the snapshot's own record (step, sequence, save time, run) inside the checkpoint dict it holds."""

RUN_ID_FILE = ".lightning-resume-run-id"
"""In the durable checkpoint directory: names the run (hidden, so no checkpoint search lists it)."""

HEADER_SLACK = 1 << 20
"""Bytes allowed for the safetensors header beyond the tree JSON (the tensor index and digests)."""


class NotEnoughSharedMemory(OSError):
    """The snapshot does not fit in the free space of the memory tier's filesystem."""

    def __init__(self, root: str, needed: int, free: int) -> None:
        self.root, self.needed, self.free = root, needed, free
        super().__init__(
            f"memory tier: a snapshot needs {needed / 2**20:.1f} MiB but {root} has {free / 2**20:.1f} MiB free; "
            "raise the size of /dev/shm (e.g. `mount -o remount,size=XXG /dev/shm`, or `--shm-size` for Docker), "
            "point ExactResume(memory_dir=...) at a larger tmpfs, or pass memory_tier=False"
        )


@dataclass(frozen=True)
class MemorySnapshot:
    """A verified snapshot: the checkpoint dict (``MEMORY_KEY`` removed) and its record."""

    path: str
    checkpoint: Dict[str, Any]
    step: int
    seq: int
    saved_at: float


def run_id(checkpoint_dir: str, create: bool) -> Optional[str]:
    """The id stored in ``checkpoint_dir`` (made and stored when missing and ``create``); ``None`` if absent.

    A durable directory deleted and started over gets a new id, so the memory tier of the old run is
    never resumed into the new one."""
    path = storage.join(str(checkpoint_dir), RUN_ID_FILE)
    try:
        found = storage.read_bytes(path).decode("ascii", "replace").strip()
        if found:
            return found
    except OSError:
        pass
    if not create:
        return None
    new = secrets.token_hex(8)
    atomic_write(path, lambda f: f.write(new.encode()))
    return new


def run_key(checkpoint_dir: str, run: str) -> str:
    """16 hex digits naming the run: its durable directory (as given, scheme kept) and its id."""
    return hashlib.sha256(f"{checkpoint_dir}\0{run}".encode()).hexdigest()[:16]


class MemoryStore:
    """One rank's slot in the memory tier: save, load (verified), free, and clean up after other runs.

    Args:
        root: the shared-memory directory (``DEFAULT_ROOT``), a local tmpfs path.
        key: the run key (:func:`run_key`).
        rank, world_size: this process's place; a snapshot is only read back by the same rank of
            the same world size.
        checksum: digest written into the file (default ``DEFAULT_ALGORITHM``, as ``SafetensorsCheckpointIO``).
        asynchronous: block only to copy the tensors into reusable host buffers (``async_save.AsyncSaver``,
            as async saves do) and write the file on a worker; a process killed meanwhile keeps the
            previous snapshot. ``False``: the snapshot is committed when :meth:`save` returns.
    """

    def __init__(
        self,
        root: str,
        key: str,
        rank: int,
        world_size: int,
        checksum: str = DEFAULT_ALGORITHM,
        asynchronous: bool = True,
    ) -> None:
        self.root, self.key, self.rank, self.world_size, self.checksum = str(root), key, rank, world_size, checksum
        self.directory = os.path.join(self.root, key)
        stem = f"rank-{rank}-of-{world_size}"
        self.path = os.path.join(self.directory, f"{stem}.safetensors")
        self.owner_path = os.path.join(self.directory, f"{stem}.owner")
        self._saver = AsyncSaver(self._commit, on_error="raise") if asynchronous else None

    def save(self, checkpoint: Dict[str, Any], step: int, seq: int, now: Optional[float] = None) -> int:
        """Snapshot ``checkpoint`` as this rank's (the previous one is replaced once the new one is complete);
        return its size in bytes. Raises ``NotEnoughSharedMemory`` before writing anything when it would
        not fit, and (asynchronous) ``AsyncWriteError`` for a previous snapshot whose write failed."""
        record: Dict[str, Any] = {"step": int(step), "seq": int(seq), "saved_at": time.time() if now is None else now}
        record.update(run=self.key, rank=self.rank, world_size=self.world_size)
        if self._saver is not None:
            self._saver.wait()  # the previous write holds shared memory until it is renamed over the old file
        tree_json, tensors = write.encode_tree({**checkpoint, MEMORY_KEY: record})
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values()) + len(tree_json)
        os.makedirs(self.directory, exist_ok=True)
        free = free_bytes(self.directory)
        if nbytes + HEADER_SLACK > free:
            raise NotEnoughSharedMemory(self.root, nbytes + HEADER_SLACK, free)
        self._claim()
        if self._saver is None:
            write.commit(self.path, tree_json, tensors, self.checksum)
        else:
            self._saver.save_encoded(tree_json, tensors, self.path)  # encoded once: the size check needed it
        return nbytes

    def _commit(self, path: str, tree_json: str, staged: StagedTensors) -> None:
        """The background write of an asynchronous snapshot (on the saver's worker thread)."""
        commit_staged(path, tree_json, staged, self.checksum)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Until the snapshot being written is committed (``False`` if ``timeout`` passed first)."""
        return True if self._saver is None else self._saver.wait(None, timeout)

    def _claim(self) -> None:
        """Record this process as the slot's writer, so no other run's cleanup removes it while it lives."""
        owner = f"{owner_token()} {os.getpid()}"
        if read_quietly(self.owner_path) != owner:
            atomic_write(self.owner_path, lambda f: f.write(owner.encode()))

    def exists(self) -> bool:
        return os.path.isfile(self.path)

    def load(self) -> Optional[MemorySnapshot]:
        """This rank's snapshot, every checksum verified; ``None`` when there is none. Raises
        ``CheckpointCorruptError`` naming the file when it does not verify or is not this slot's."""
        self.wait()
        if not self.exists():
            return None
        loaded = read.load_file(self.path, verify=True).checkpoint
        record = loaded.pop(MEMORY_KEY, None)
        expected = {"run": self.key, "rank": self.rank, "world_size": self.world_size}
        if not isinstance(record, dict) or any(record.get(k) != v for k, v in expected.items()):
            raise CheckpointCorruptError(self.path, "not this slot's memory-tier snapshot", expected, record)
        return MemorySnapshot(self.path, loaded, int(record["step"]), int(record["seq"]), float(record["saved_at"]))

    def free(self) -> None:
        """Remove this rank's snapshot (a clean end of training), and the run directory once empty."""
        if self._saver is not None:
            self._saver.close()  # a write still in flight would otherwise commit after the removal
        for path in (self.path, self.owner_path):
            remove_quietly(path)
        with contextlib.suppress(OSError):  # another rank's snapshot is still there, or it is already gone
            os.rmdir(self.directory)

    def clean_stale(self, now: Optional[float] = None) -> List[str]:
        """Remove other runs' directories under ``root`` that no live process owns; return them.

        A directory is stale when every owner recorded in it is a process of this host (same owner token)
        that is no longer alive *and* nothing in it changed for ``STALE_AFTER_S``, or, for owners this host
        cannot check, when untouched that long. A crashed run's snapshot is therefore kept for a day for
        its relaunch; a finished run frees its own at once (:meth:`free`)."""
        now = time.time() if now is None else now
        removed = []
        try:
            names = sorted(os.listdir(self.root))
        except OSError:
            return []
        for name in names:
            directory = os.path.join(self.root, name)
            if name != self.key and os.path.isdir(directory) and _stale(directory, now):
                shutil.rmtree(directory, ignore_errors=True)
                removed.append(directory)
        return removed


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged process can still write under ``directory``."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def _stale(directory: str, now: float) -> bool:
    try:
        names = os.listdir(directory)
        newest = max((os.stat(os.path.join(directory, n)).st_mtime for n in names), default=0.0)
    except OSError:
        return False
    if now - newest <= STALE_AFTER_S:
        return False
    mine = owner_token()
    for name in names:
        if name.endswith(".owner"):
            token, _, pid = read_quietly(os.path.join(directory, name)).partition(" ")
            if token == mine and pid.isdigit() and pid_alive(int(pid)):
                return False
    return True


def durable_step(path: Optional[str]) -> int:
    """The global step of a durable checkpoint of our format, from its header alone; ``-1`` when there is no
    checkpoint or its step cannot be read (a legacy ``torch.save`` file, a sharded directory, damage)."""
    if not path:
        return -1
    try:
        step = read.global_step(read.read_summary(str(path)))
    except Exception:  # noqa: BLE001 - damage of any kind: the step is unknown, the memory snapshot decides
        return -1
    return -1 if step is None else step
