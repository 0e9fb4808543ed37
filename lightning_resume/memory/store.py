"""The memory tier: one full checkpoint per rank in shared memory, outliving the process that wrote it.

A process killed by an exception, the OOM killer or a deploy leaves ``/dev/shm`` intact while the node
lives, so a snapshot there costs one copy and loses almost nothing. Each rank's snapshot is one file in
the project's safetensors format (checksummed), written through ``write.commit`` into a temporary and
renamed over the previous one: a reader never sees half a snapshot, and the old one goes only once the
new one is complete. tmpfs has no disk behind it, so its ``fsync`` costs nothing.

Layout: ``<memory dir>/lightning-resume-<uid>/<slot>/rank-<r>-of-<w>.safetensors`` plus
``rank-<r>-of-<w>.owner`` (owner token and pid, for stale cleanup), and, with replicas on, ``replica-<o>-of-<w>.safetensors``:
the exact bytes of rank ``o``'s snapshot, received from that peer (``memory.replicate``) and written as a
snapshot is (:meth:`MemoryStore.write_received`), verified when read (:meth:`MemoryStore.check_replica`). A save
replicated to every holder is also kept under ``<name>.keep-<seq>.safetensors`` (:func:`keep_name`): a hard link
to the same file, free until the next commit renames a new file over the name, so the newest save that every
holder stored (the anchor, ``memory.replicate.agree``) outlives a newer one still in transit
(:meth:`MemoryStore.keep`, :meth:`MemoryStore.prune`). ``/dev/shm`` is shared by every user of
the node, so each user has a root of their own, mode 0700, opened once as a directory descriptor and checked
on it (owner, mode, not a link; ``storage.private.open_private_dir``); the slot is opened relative to it and
every file reached relative to the slot's descriptor, so no rename of a path component (possible where the
memory dir is writable by others without the sticky bit) changes what is read or written. Every file is
created new (``O_EXCL | O_NOFOLLOW``) with mode 0600: another user can neither read a snapshot nor put one in
our place. When another user holds the root's name first, the tier uses a fallback root of a random name
(:func:`fallback_root`; chosen by ``memory.tier``). The slot hashes the durable
checkpoint directory; the run id inside each snapshot must equal the one in the durable checkpoint the
relaunch resolved (``ExactResume`` writes it into every checkpoint), so a run whose checkpoint directory
was cleared starts over instead of resuming an older run's snapshot. The step, save sequence, save time
and run id travel inside the file (``MEMORY_KEY``), committed with it. This module knows files and
tensors, not Lightning.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import stat
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from lightning_resume._compat.torch_ops import NBYTES
from lightning_resume.errors import CheckpointCorruptError, ExactResumeWarning
from lightning_resume.format import read, write
from lightning_resume.format.atomic import (
    STALE_AFTER_S,
    atomic_write,
    atomic_write_in,
    owner_token,
    pid_alive,
    temp_name,
)
from lightning_resume.format.codec import decode, parse_tree
from lightning_resume.format.in_place import TreePath
from lightning_resume.format.integrity import DEFAULT_ALGORITHM
from lightning_resume.io import resolve
from lightning_resume.staging.async_save import AsyncSaver, commit_staged
from lightning_resume.staging.buffers import StagedTensors
from lightning_resume.staging.lending import Offer
from lightning_resume.staging.overlap import CopyStats
from lightning_resume.storage.private import (
    PRIVATE_FILE_MODE,
    UntrustedDirectory,
    fd_path,
    open_private_dir,
    owned_by_me,
    read_small,
    user_root,
)

log = logging.getLogger(__name__)

ROOT_PREFIX = "lightning-resume"
"""The memory root is ``<memory dir>/lightning-resume-<uid>``: one per user, never shared."""

MEMORY_KEY = "lightning_resume_memory_tier"
"""Key of the snapshot's own record (step, sequence, save time, run) inside the checkpoint dict it holds."""

HEADER_SLACK = 1 << 20
"""Bytes allowed for the safetensors header beyond the tree JSON (the tensor index and digests)."""


_SLOT = re.compile(r"^[0-9a-f]{16}$")
"""A slot directory's name (:func:`slot_key`): cleanup looks at nothing else."""

_OWN_FILE = re.compile(r"^\.?(?:rank|replica)-\d+-of-\d+(?:\.keep-\d+)?\.(?:safetensors|owner)(?:\.tmp-[0-9a-f-]+)?$")
"""What a slot holds: snapshots, replicas of peers' snapshots, the saves kept of either, owner files, and the
temporaries of interrupted writes or links of any of them."""

_KEEP = re.compile(r"^((?:rank|replica)-(\d+)-of-(\d+))\.keep-(\d+)\.safetensors$")
"""A kept save's name (:func:`keep_name`): the name it was kept from, its owner rank, world size and sequence."""

_REPLICA = re.compile(r"^replica-(\d+)-of-(\d+)\.safetensors$")
"""A replica's name (:func:`replica_name`)."""


_FALLBACK = re.compile(rf"^{ROOT_PREFIX}-\d+-[0-9a-f]{{16}}$")
"""A fallback root's name (:func:`fallback_root`): a recorded name is used only when it looks like one."""


def memory_root(memory_dir: str) -> str:
    """This user's memory root under ``memory_dir`` (not made or checked here: :class:`MemoryStore` does)."""
    return user_root(str(memory_dir), ROOT_PREFIX)


def fallback_root(memory_dir: str, token: str) -> Optional[str]:
    """``<memory dir>/lightning-resume-<uid>-<token>``: this user's root when another user holds the name of
    :func:`memory_root`; ``None`` when ``token`` (16 hex digits, random, recorded in the run's checkpoints) is
    not one, so an edited checkpoint cannot point the tier elsewhere."""
    name = f"{os.path.basename(memory_root(memory_dir))}-{token}"
    return os.path.join(str(memory_dir), name) if _FALLBACK.match(name) else None


def squatted(root: str) -> Optional[str]:
    """Why ``root`` cannot be this user's memory root (another user's directory, a file, a link, an open mode),
    or ``None`` when it is one: made here (0700) when missing, so no one can take the name after this check."""
    try:
        os.makedirs(os.path.dirname(root), exist_ok=True)
        os.close(open_private_dir(root, create=True))
    except UntrustedDirectory as err:
        return err.reason
    except OSError:
        return None  # cannot be made (said at the first snapshot, which tries again)
    return None


class NotEnoughSharedMemory(OSError):
    """The snapshot (or a peer's replica, ``what``) does not fit in the free space of the memory tier's filesystem."""

    def __init__(self, root: str, needed: int, free: int, what: str = "a snapshot") -> None:
        self.root, self.needed, self.free = root, needed, free
        super().__init__(
            f"memory tier: {what} needs {needed / 2**20:.1f} MiB but {root} has {free / 2**20:.1f} MiB free; "
            "raise the size of /dev/shm (e.g. `mount -o remount,size=XXG /dev/shm`, or `--shm-size` for Docker), "
            "point MemoryTierOptions(dir=...) at a larger tmpfs, or pass memory_tier=None"
        )


@dataclass(frozen=True)
class MemorySnapshot:
    """A verified snapshot: the checkpoint dict (``MEMORY_KEY`` removed) and its record. ``in_place``: the tensors
    read straight into the caller's (``MemoryStore.load(into=...)``), by tree path, with the file's recorded
    ``(algorithm, digest)`` of their bytes (``read.Loaded.in_place``)."""

    path: str
    checkpoint: Dict[str, Any]
    step: int
    seq: int
    saved_at: float
    in_place: Dict[TreePath, Tuple[str, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Checked:
    """A file of the slot whose every byte was checked against its digests through ``fd`` (``check``) or as it was
    written through it (``write_received(verify=True)``): the next load of it reads that descriptor, not the
    name, without a second digest pass. ``tree``: its checkpoint with tensor stand-ins (the record inside)."""

    fd: int
    tree: Dict[str, Any]


def replica_name(owner: int, world_size: int) -> str:
    """``replica-<owner>-of-<w>.safetensors``: the name, in the holder's slot, of rank ``owner``'s snapshot as its
    replica: the exact bytes of the owner's ``rank-<owner>-of-<w>.safetensors``."""
    return f"replica-{owner}-of-{world_size}.safetensors"


def keep_name(name: str, seq: int) -> str:
    """``<stem>.keep-<seq>.safetensors``: the name under which save ``seq`` of the snapshot or replica ``name``
    (``<stem>.safetensors``) is kept once every holder stored it, while newer ones replace ``name``."""
    stem = name[: -len(".safetensors")] if name.endswith(".safetensors") else name
    return f"{stem}.keep-{int(seq)}.safetensors"


@dataclass(frozen=True)
class Kept:
    """A kept save in the slot (:func:`keep_name`): its file name, the name it was kept from, whose and which save."""

    name: str
    of: str
    owner: int
    seq: int


def slot_key(checkpoint_dir: str) -> str:
    """16 hex digits naming the slot of the run that saves into ``checkpoint_dir`` (as given, scheme kept)."""
    return hashlib.sha256(str(checkpoint_dir).encode()).hexdigest()[:16]


class MemoryStore:
    """One rank's slot in the memory tier: save, load (verified), free, and clean up after other runs.

    Args:
        root: this user's memory root (:func:`memory_root`), a local tmpfs path; made (0700) at the first
            save, checked before every save and load (``storage.private.UntrustedDirectory`` when it fails).
        key: the slot (:func:`slot_key`).
        rank, world_size: this process's place; a snapshot is only read back by the same rank of
            the same world size.
        checksum: digest written into the file (default ``DEFAULT_ALGORITHM``, as ``SafetensorsCheckpointIO``).
        asynchronous: block only to copy the tensors into reusable host buffers (``async_save.AsyncSaver``,
            as async saves do) and write the file on a worker; a process killed meanwhile keeps the
            previous snapshot. ``False``: the snapshot is committed when :meth:`save` returns.
        overlap_copy: with ``asynchronous``, copy at the save only what may change before the next optimizer
            step and the rest while the next forward and backward run (``staging.overlap``, as
            ``SafetensorsCheckpointIO(save="overlapped")``): the snapshot is committed after that step's
            barrier, and holds the state as it was at the save.
    """

    def __init__(
        self,
        root: str,
        key: str,
        rank: int,
        world_size: int,
        checksum: str = DEFAULT_ALGORITHM,
        asynchronous: bool = True,
        overlap_copy: bool = False,
    ) -> None:
        if overlap_copy and not asynchronous:
            raise ValueError("overlap_copy=True copies while training goes on; it needs asynchronous=True")
        self.root, self.key, self.rank, self.world_size, self.checksum = str(root), key, rank, world_size, checksum
        self.directory = os.path.join(self.root, key)
        stem = f"rank-{rank}-of-{world_size}"
        self.name, self.owner_name = f"{stem}.safetensors", f"{stem}.owner"
        self.path = os.path.join(self.directory, self.name)  # as named in messages; reached through the slot fd
        self.owner_path = os.path.join(self.directory, self.owner_name)
        self._root_fd: Optional[int] = None
        self._slot_fd: Optional[int] = None
        self._after: Optional[tuple[Committed, int, int]] = None  # the asynchronous snapshot's after_commit
        self._fds = threading.RLock()  # a replica is written on the replicator's thread, snapshots on the saver's
        self._checked: Dict[str, _Checked] = {}  # by name: the one file of that name checked and still open
        self._saver = AsyncSaver(self._commit, on_error="raise", overlapped=overlap_copy) if asynchronous else None

    def save(
        self,
        checkpoint: Dict[str, Any],
        step: int,
        seq: int,
        run: str,
        now: Optional[float] = None,
        borrow: Optional[Offer] = None,
        after_commit: Optional[Committed] = None,
    ) -> int:
        """Snapshot ``checkpoint`` of run ``run`` as this rank's (the previous one is replaced once the new one
        is complete); return its size in bytes. ``borrow`` (asynchronous): a durable save's offer of the same
        state at the same point (``staging.lending``): the tensors it holds are written from its staging, not copied
        again (:attr:`last_borrowed_bytes`). ``after_commit(fd, step, seq)``: called once the snapshot is committed
        (on the saver's thread when asynchronous) with a descriptor of the committed file, which it closes; its
        errors are logged, never the snapshot's. Raises ``NotEnoughSharedMemory`` before writing anything when
        it would not fit, ``UntrustedDirectory`` when the root or slot is not this user's alone, and
        (asynchronous) ``AsyncWriteError`` for a previous snapshot whose write failed."""
        self._forget(self.name)  # what a later load reads is this save's file, checked as it is read
        record: Dict[str, Any] = {"step": int(step), "seq": int(seq), "saved_at": time.time() if now is None else now}
        record.update(slot=self.key, run=str(run), rank=self.rank, world_size=self.world_size)
        tree = {**checkpoint, MEMORY_KEY: record}
        if self._saver is not None:
            self._saver.wait()  # the previous write holds shared memory until it is renamed over the old file
            self._after = None if after_commit is None else (after_commit, int(step), int(seq))
            encoded = self._saver.encode(tree)  # the kept encoding reused, as a durable async save does
            tree_json, tensors = encoded.tree_json, encoded.tensors
        else:
            tree_json, tensors = write.encode_tree(tree)
        nbytes = sum(map(NBYTES, tensors.values())) + len(tree_json)
        slot = self._slot(create=True)
        if slot is None:  # the memory dir vanished while the root was being made
            raise FileNotFoundError(errno.ENOENT, "memory tier: no slot could be made", self.directory)
        free = free_bytes(fd_path(slot, self.directory))
        if nbytes + HEADER_SLACK > free:
            raise NotEnoughSharedMemory(self.root, nbytes + HEADER_SLACK, free)
        self._claim(slot)
        target = os.path.join(fd_path(slot, self.directory), self.name)  # the checked slot itself, not its name
        if self._saver is None:
            write.commit(target, tree_json, tensors, self.checksum, mode=PRIVATE_FILE_MODE)
            if after_commit is not None:
                self._notify((after_commit, int(step), int(seq)))
        else:
            self._saver.save_text(encoded, target, borrow)  # encoded once: the size check needed it
        return nbytes

    @property
    def last_borrowed_bytes(self) -> int:
        """Bytes the newest snapshot took from a durable save's staging instead of copying them (``borrow``)."""
        return 0 if self._saver is None else self._saver.stats.borrowed_bytes

    @property
    def last_copy(self) -> Optional[CopyStats]:
        """With ``overlap_copy``: the newest snapshot's overlapped copy once its barrier passed (``None`` before)."""
        return None if self._saver is None else self._saver.stats.copy

    def _root(self, create: bool) -> Optional[int]:
        """The root's descriptor, opened once (made 0700 with ``create``) and checked on the descriptor; ``None``
        when it is missing. Reopened by name only once the directory it held was removed (a cleared tmpfs)."""
        if self._root_fd is not None and os.fstat(self._root_fd).st_nlink == 0:
            self._close()
        if self._root_fd is None:
            if create:  # the memory dir itself (e.g. /dev/shm) may be shared
                os.makedirs(os.path.dirname(self.root), exist_ok=True)
            try:
                self._root_fd = open_private_dir(self.root, create=create)
            except FileNotFoundError:
                return None
        return self._root_fd

    def _slot(self, create: bool) -> Optional[int]:
        """The slot's descriptor, opened relative to the root's and checked as it is; ``None`` when missing."""
        with self._fds:
            if self._slot_fd is not None and os.fstat(self._slot_fd).st_nlink == 0:
                self._close()
            root = self._root(create)
            if root is None:
                return None
            if self._slot_fd is None:
                try:
                    self._slot_fd = open_private_dir(self.key, root, create=create, shown=self.directory)
                except FileNotFoundError:
                    return None
            return self._slot_fd

    def _close(self) -> None:
        self._forget()
        with self._fds:
            for fd in (self._slot_fd, self._root_fd):
                if fd is not None:
                    os.close(fd)
            self._root_fd = self._slot_fd = None

    def _commit(self, path: str, tree_json: str, staged: StagedTensors) -> None:
        """The background write of an asynchronous snapshot (on the saver's worker thread). The next save waits
        for it before it sets :attr:`_after` again, so the hand-over read here is this snapshot's."""
        commit_staged(path, tree_json, staged, self.checksum, mode=PRIVATE_FILE_MODE)
        after, self._after = self._after, None
        if after is not None:
            self._notify(after)

    def _notify(self, after: tuple[Committed, int, int]) -> None:
        """Hand the snapshot just committed, open, to ``after_commit``: the file, not whatever replaces it later."""
        call, step, seq = after
        try:
            fd = self.open_committed()
            if fd is not None:
                call(fd, step, seq)
        except Exception:  # the snapshot is committed; what follows it must not undo that
            log.exception("memory tier: handing over the committed snapshot %s failed", self.path)

    def open_committed(self, name: Optional[str] = None) -> Optional[int]:
        """A read-only descriptor of this rank's committed snapshot (or of the replica ``name`` in the slot), or
        ``None`` when there is none: the file as it is now, whatever a later commit renames over it."""
        slot = self._slot(create=False)
        if slot is None:
            return None
        try:
            return os.open(name or self.name, _READ_FLAGS, dir_fd=slot)
        except FileNotFoundError:
            return None

    def replica_path(self, owner: int) -> str:
        """Where rank ``owner``'s replica is in this rank's slot (as named in messages; reached through the slot)."""
        return os.path.join(self.directory, replica_name(owner, self.world_size))

    def replica_owners(self) -> List[int]:
        """The ranks (of this world size) whose replicas this rank's slot holds, in rank order."""
        slot = self._slot(create=False)
        if slot is None:
            return []
        found = (_REPLICA.match(n) for n in os.listdir(fd_path(slot, self.directory)))
        return sorted(int(m[1]) for m in found if m is not None and int(m[2]) == self.world_size)

    def keep(self, name: str, seq: int) -> str:
        """Keep the committed file ``name`` of this slot (this rank's snapshot or a replica) as save ``seq``: a hard
        link (:func:`keep_name`), free while ``name`` is the same file, that outlives the next file renamed over
        ``name``. Made under a temporary name and renamed into place, so a keep is whole or absent. Its name."""
        kept = keep_name(name, seq)
        self._link(name, kept)
        return kept

    def reinstate(self, kept: str) -> None:
        """Make the kept save ``kept`` of this rank's snapshot its current snapshot again (a recovery chose it),
        atomically: linked under a temporary name, renamed over the current one."""
        match = _KEEP.match(kept)
        if match is None or f"{match[1]}.safetensors" != self.name:
            raise ValueError(f"{kept!r} is not a kept save of {self.name}")
        self._link(kept, self.name)

    def _link(self, src: str, dst: str) -> None:
        with self._fds:
            slot = self._slot(create=False)
            if slot is None:
                raise FileNotFoundError(errno.ENOENT, "memory tier: no slot", self.directory)
            tmp = temp_name(dst)
            os.link(src, tmp, src_dir_fd=slot, dst_dir_fd=slot, follow_symlinks=False)
            try:
                os.replace(tmp, dst, src_dir_fd=slot, dst_dir_fd=slot)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=slot)
                raise
            self._forget(dst)  # a descriptor checked before reads the file the name held, not this one

    def kept(self, owners: Iterable[int] = ()) -> List[Kept]:
        """The kept saves in the slot of this rank's snapshot and of the replicas of ``owners``, by name."""
        slot = self._slot(create=False)
        if slot is None:
            return []
        mine = {self.name, *(replica_name(o, self.world_size) for o in owners)}
        found = (_KEEP.match(n) for n in sorted(os.listdir(fd_path(slot, self.directory))))
        keeps = (Kept(m[0], f"{m[1]}.safetensors", int(m[2]), int(m[4])) for m in found if m is not None)
        return [k for k in keeps if k.of in mine]

    def prune(self, below: Optional[int], owners: Iterable[int] = ()) -> List[str]:
        """Remove the kept saves of this rank's snapshot and of the replicas of ``owners`` older than save ``below``
        (the anchor: a complete newer set exists), or all of them (``None``); the names removed."""
        slot = self._slot(create=False)
        gone = [k.name for k in self.kept(owners) if below is None or k.seq < below]
        for name in gone:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=slot)
        return gone

    def footprint(self, owners: Iterable[int] = ()) -> tuple[int, int]:
        """(bytes of this rank's snapshot and of the replicas of ``owners`` in the slot, bytes free there): what
        keeping each of them once more may pin, against the room (``(0, 0)`` before the slot exists)."""
        slot = self._slot(create=False)
        if slot is None:
            return 0, 0
        held = 0
        for name in (self.name, *(replica_name(o, self.world_size) for o in owners)):
            with contextlib.suppress(FileNotFoundError):
                held += os.stat(name, dir_fd=slot, follow_symlinks=False).st_size
        return held, free_bytes(fd_path(slot, self.directory))

    def discard(self, names: Iterable[str]) -> None:
        """Remove the replicas ``names`` from the slot (a recovery found them newer than the save the run resumed)."""
        slot = self._slot(create=False)
        for name in names:
            if not _REPLICA.match(name):
                raise ValueError(f"{name!r} is not a replica's name")
            self._forget(name)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=slot)

    def check_kept(self, kept: Kept, run: str) -> MemorySnapshot:
        """The record of the kept save ``kept``, read from its header alone (its digests are checked when it is
        used: loaded, or received by its owner); ``CheckpointCorruptError`` when the header does not check or the
        record is not ``kept.owner``'s save ``kept.seq`` of this slot and run ``run``."""
        slot = self._slot(create=False)
        shown = os.path.join(self.directory, kept.name)
        if slot is None:
            raise FileNotFoundError(errno.ENOENT, "memory tier: no slot", self.directory)
        summary = read.read_summary(os.path.join(fd_path(slot, self.directory), kept.name))
        try:
            record = decode(parse_tree(summary.tree_json)["v"][MEMORY_KEY], {})
        except (KeyError, TypeError, ValueError, RecursionError) as err:
            raise CheckpointCorruptError(shown, f"no memory-tier record in its header: {err}") from err
        expected = {"slot": self.key, "rank": kept.owner, "world_size": self.world_size, "run": run, "seq": kept.seq}
        return _snapshot(shown, {}, record, expected, "not the kept save its name says")

    def write_received(self, name: str, nbytes: int, chunks: Iterable[memoryview], verify: bool = False) -> str:
        """Write ``nbytes`` arriving as ``chunks`` as the file ``name`` of this slot (a peer's replica,
        :func:`replica_name`, or this rank's own snapshot received from a holder), atomically: a temporary
        created new (``O_EXCL | O_NOFOLLOW``, 0600) relative to the slot's descriptor, renamed over the old file
        once whole. Returns its path. Raises ``NotEnoughSharedMemory`` before writing anything when it would
        not fit, ``CheckpointCorruptError`` when the chunks hold another number of bytes (nothing is renamed).
        ``verify``: also check the header and each tensor's digest as its bytes arrive (``read.StreamCheck``): a
        mismatch is a ``CheckpointCorruptError`` naming the tensor, raised before the rename, so the old file
        stays; a file checked so is kept open, and the next :meth:`check` or :meth:`load` of it reads it from
        there without a second digest pass."""
        if name != self.name and not ((m := _REPLICA.match(name)) and int(m[2]) == self.world_size):
            raise ValueError(f"{name!r} is neither {self.name} nor a replica of world size {self.world_size}")
        slot = self._slot(create=True)
        if slot is None:
            raise FileNotFoundError(errno.ENOENT, "memory tier: no slot could be made", self.directory)
        free = free_bytes(fd_path(slot, self.directory))
        if nbytes > free:
            raise NotEnoughSharedMemory(self.root, nbytes, free, f"the received file {name}")
        self._claim(slot)
        self._forget(name)
        shown = os.path.join(self.directory, name)
        check = read.StreamCheck(shown, nbytes) if verify else None
        tree: Dict[str, Any] = {}

        def write(f: BinaryIO) -> None:
            stream = chunks if check is None else (piece for chunk in chunks for piece in check.pieces(chunk))
            written = _write_chunks(f, stream, nbytes)
            if written != nbytes:  # raised before the rename: the temporary is removed, the old file stays
                raise CheckpointCorruptError(shown, "the received bytes are not the size announced", nbytes, written)
            if check is not None:
                tree.update(check.finish())  # a digest that does not match: raised before the rename too

        kept = atomic_write_in(slot, name, write, PRIVATE_FILE_MODE, keep_open=verify)  # synced: a disk, too
        if kept is not None:
            self._remember(name, _Checked(kept, tree))
        return shown

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Until the snapshot being written is committed (``False`` if ``timeout`` passed first)."""
        return True if self._saver is None else self._saver.wait(None, timeout)

    def _claim(self, slot: int) -> None:
        """Record this process as the slot's writer, so no other run's cleanup removes it while it lives."""
        owner = f"{owner_token()} {os.getpid()}"
        path = os.path.join(fd_path(slot, self.directory), self.owner_name)
        if read_small(path) != owner:
            atomic_write(path, lambda f: f.write(owner.encode()), PRIVATE_FILE_MODE)

    def close(self) -> None:
        """Stop using this store (the write in flight committed first), leaving its snapshot in place."""
        if self._saver is not None:
            self._saver.close()
        self._close()

    def exists(self) -> bool:
        slot = self._slot(create=False)
        if slot is None:
            return False
        with contextlib.suppress(OSError):
            return stat.S_ISREG(os.stat(self.name, dir_fd=slot, follow_symlinks=False).st_mode)
        return False

    def load(
        self, run: str, into: Optional[Mapping[TreePath, torch.Tensor]] = None, into_owner: str = "its caller"
    ) -> Optional[MemorySnapshot]:
        """This rank's snapshot of run ``run``, every checksum verified; ``None`` when there is none. Raises
        ``UntrustedDirectory`` when the root or slot is not this user's alone, and ``CheckpointCorruptError``
        naming the file when it does not verify or is not this slot's or this run's. ``into``, ``into_owner``:
        tensors to read the snapshot's straight into, and whose they are (``read.ReadOptions``; the snapshot's
        ``in_place`` says which were). A snapshot this store already checked (:meth:`check`,
        ``write_received(verify=True)``) is read from the descriptor it was checked through, once, not checked
        again (see :meth:`_load_checked`)."""
        self.wait()
        what = "not this slot's or this run's memory-tier snapshot"
        checked = self._take(self.name)
        if checked is not None:
            return self._load_checked(checked, run, what, into, into_owner)
        return self._load(self.name, self.rank, run, what, into=into, into_owner=into_owner)

    def check(self, run: str) -> Optional[MemorySnapshot]:
        """:meth:`load` without keeping the tensors (the snapshot's ``checkpoint`` holds 1-element stand-ins): every
        checksum verified from plain reads a chunk at a time, and the record checked. The file stays open, so the
        :meth:`load` that follows reads it, and only it, without a second digest pass. A file written here and
        checked as it arrived (``write_received(verify=True)``) is not read again at all: its record is at hand."""
        self.wait()
        what = "not this slot's or this run's memory-tier snapshot"
        with self._fds:
            checked = self._checked.get(self.name)
        if checked is not None:
            return self._snapshot(self.path, dict(checked.tree), self.rank, run, what)
        return self._load(self.name, self.rank, run, what, stand_ins=True, keep=True)

    def check_replica(self, owner: int, run: str) -> Optional[MemorySnapshot]:
        """Rank ``owner``'s replica in this rank's slot, verified as :meth:`load` verifies a snapshot (every checksum,
        from plain reads, one chunk at a time; the record inside says rank ``owner``, this world size, this slot and
        run ``run``) without keeping the tensors: the snapshot's ``checkpoint`` holds 1-element stand-ins for them;
        ``None`` when there is none, ``CheckpointCorruptError`` naming the file when it does not verify.
        What a holder offers at a relaunch, in the memory of a chunk, whatever the replica's size."""
        what = f"not rank {owner}'s memory-tier snapshot of this slot and run"
        return self._load(replica_name(owner, self.world_size), owner, run, what, stand_ins=True)

    def _load(
        self,
        name: str,
        rank: int,
        run: str,
        what: str,
        stand_ins: bool = False,
        keep: bool = False,
        into: Optional[Mapping[TreePath, torch.Tensor]] = None,
        into_owner: str = "its caller",
    ) -> Optional[MemorySnapshot]:
        slot = self._slot(create=False)
        if slot is None:
            return None
        shown = os.path.join(self.directory, name)
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=slot)  # this slot's file, whatever its path names now
        except FileNotFoundError:
            return None
        kept: Optional[int] = None
        with os.fdopen(fd, "rb", buffering=0) as f:
            if stand_ins:
                loaded, placed = read.verify_open(shown, f), {}
                kept = os.dup(f.fileno()) if keep else None
            else:
                done = read.load_open(shown, f, verify=True, into=into, into_owner=into_owner)
                loaded, placed = done.checkpoint, done.in_place
        tree = dict(loaded)  # the record still in it, for the check that reads no file again
        try:
            snapshot = self._snapshot(shown, loaded, rank, run, what, placed)
        except BaseException:
            if kept is not None:  # a foreign record: nothing is kept
                os.close(kept)
            raise
        if kept is not None:
            self._remember(name, _Checked(kept, tree))
        return snapshot

    def _load_checked(
        self,
        checked: _Checked,
        run: str,
        what: str,
        into: Optional[Mapping[TreePath, torch.Tensor]],
        into_owner: str,
    ) -> Optional[MemorySnapshot]:
        """This rank's snapshot read from ``checked.fd``, without a digest pass.

        Why the bytes read here are the bytes already checked, with nothing reopened by name: ``checked.fd`` is
        the open file description the check went through: :meth:`check` hashed every byte read through it, or
        ``write_received(verify=True)`` hashed every chunk in memory right before writing that same memory
        through it, into a file it created new (``O_EXCL | O_NOFOLLOW``, 0600). A rename over the name, a removal
        or a cleared tmpfs cannot change what this descriptor reads: it is that inode, not the name. The inode
        itself lies in a slot of this user's private root (0700, its owner and mode checked on the descriptor),
        and is mode 0600, so no other user can open it to write; this package never writes a committed file in
        place (every save is a new file renamed over the old one); and the descriptor is dropped by any save or
        receipt of the same name and at close, and used once. So only this user's own processes, or root,
        writing the file in place by hand, could make these bytes differ from the ones checked; digests guard
        against damage, not against the owner (``format.integrity``). The header and tree are parsed and the
        record checked again, as any load does."""
        with os.fdopen(checked.fd, "rb", buffering=0) as f:
            f.seek(0)
            done = read.load_open(self.path, f, verify=False, into=into, into_owner=into_owner)
        return self._snapshot(self.path, done.checkpoint, self.rank, run, what, done.in_place)

    def _snapshot(
        self,
        shown: str,
        loaded: Dict[str, Any],
        rank: int,
        run: str,
        what: str,
        placed: Optional[Dict[TreePath, Tuple[str, str]]] = None,
    ) -> MemorySnapshot:
        """``loaded`` as the snapshot of ``rank`` in run ``run``, once its record says so (``what`` when not)."""
        record = loaded.pop(MEMORY_KEY, None)
        expected = {"slot": self.key, "rank": rank, "world_size": self.world_size, "run": run}
        return _snapshot(shown, loaded, record, expected, what, placed)

    def _remember(self, name: str, checked: _Checked) -> None:
        with self._fds:
            self._forget(name)
            self._checked[name] = checked

    def _take(self, name: str) -> Optional[_Checked]:
        with self._fds:
            return self._checked.pop(name, None)

    def _forget(self, name: Optional[str] = None) -> None:
        """Close the checked descriptor of ``name`` (``None``: of every file)."""
        with self._fds:
            names = list(self._checked) if name is None else [name]
            for dropped in (self._checked.pop(n, None) for n in names):
                if dropped is not None:
                    os.close(dropped.fd)

    def free(self) -> None:
        """Remove this rank's snapshot and the replicas it holds, with their kept saves (a clean end of training),
        and the slot once empty."""
        if self._saver is not None:
            self._saver.close()  # a write still in flight would otherwise commit after the removal
        try:
            slot = self._slot(create=False)
        except OSError:
            slot = None  # not ours: nothing of ours to remove
        if slot is not None:
            owners = self.replica_owners()
            replicas = [replica_name(owner, self.world_size) for owner in owners]
            keeps = [k.name for k in self.kept(range(self.world_size))]  # also those of replicas replaced meanwhile
            for name in (self.name, self.owner_name, *replicas, *keeps):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=slot)
            with contextlib.suppress(OSError):  # another rank's snapshot is still there, or it is already gone
                os.rmdir(self.key, dir_fd=self._root_fd)
        self._close()

    def clean_stale(self, now: Optional[float] = None) -> List[str]:
        """Remove other runs' slots under this user's root that no live process owns; return them.

        Only what this package provably made is touched: a directory of this user (not a link) named like a
        slot, holding nothing but snapshot, owner and temporary files, each removed by name (never a
        recursive delete). It is stale when every owner recorded in it is a process of this host (same owner
        token) that is no longer alive *and* nothing in it changed for ``STALE_AFTER_S``, or, for owners this
        host cannot check, when untouched that long. A crashed run's snapshot is therefore kept for a day for
        its relaunch; a finished run frees its own at once (:meth:`free`). A problem is warned, never raised."""
        now = time.time() if now is None else now
        removed = []
        try:
            root = self._root(create=False)
            names = [] if root is None else sorted(os.listdir(root))
        except OSError:
            return []
        if root is None:
            return []
        for name in names:
            directory = os.path.join(self.root, name)
            reached = os.path.join(fd_path(root, self.root), name)  # through the checked root, not its name
            try:
                if name != self.key and _SLOT.match(name) and _is_stale_slot(reached, now):
                    _remove_slot(reached)
                    removed.append(directory)
            except OSError as err:
                warnings.warn(f"memory tier: left {directory} in place ({err})", ExactResumeWarning, stacklevel=2)
        return removed


def _snapshot(
    shown: str,
    loaded: Dict[str, Any],
    record: Any,
    expected: Dict[str, Any],
    what: str,
    placed: Optional[Dict[TreePath, Tuple[str, str]]] = None,
) -> MemorySnapshot:
    """The snapshot whose record (``MEMORY_KEY``) says ``expected``; else ``CheckpointCorruptError`` saying ``what``.
    ``placed``: the tensors read into the caller's (``MemorySnapshot.in_place``)."""
    if not isinstance(record, dict) or any(record.get(k) != v for k, v in expected.items()):
        got = {k: record.get(k) for k in expected} if isinstance(record, dict) else record
        raise CheckpointCorruptError(shown, what, expected, got)
    step, seq, saved_at = int(record["step"]), int(record["seq"]), float(record["saved_at"])
    return MemorySnapshot(shown, loaded, step, seq, saved_at, dict(placed or {}))


_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
"""A snapshot is read as itself: never through a link, never waiting on a FIFO."""

Committed = Callable[[int, int, int], None]
"""``after_commit(fd, step, seq)`` of :meth:`MemoryStore.save`: the committed snapshot's descriptor (the callee
closes it), step and save sequence."""


def _write_chunks(f: BinaryIO, chunks: Iterable[memoryview], limit: int) -> int:
    """Write ``chunks`` in order, stopping past ``limit`` bytes; the bytes seen."""
    seen = 0
    for chunk in chunks:
        seen += len(chunk)
        if seen > limit:
            return seen
        f.write(chunk)
    return seen


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged process can still write under ``directory``."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def _is_stale_slot(directory: str, now: float) -> bool:
    """A slot of this user, holding only our files, none changed for ``STALE_AFTER_S``, no owner alive."""
    if not owned_by_me(directory) or not os.path.isdir(directory):
        return False
    names = os.listdir(directory)
    if not all(_OWN_FILE.match(n) for n in names):
        return False  # something we did not write: not ours to delete
    newest = 0.0
    for n in names:
        st = os.lstat(os.path.join(directory, n))
        if st.st_uid != os.geteuid():
            return False
        newest = max(newest, st.st_mtime)
    if now - newest <= STALE_AFTER_S:
        return False
    mine = owner_token()
    for name in names:
        if name.endswith(".owner"):
            token, _, pid = read_small(os.path.join(directory, name)).partition(" ")
            if token == mine and pid.isdigit() and pid_alive(int(pid)):
                return False
    return True


def _remove_slot(directory: str) -> None:
    for name in os.listdir(directory):
        if _OWN_FILE.match(name):
            os.unlink(os.path.join(directory, name))
    os.rmdir(directory)  # fails, leaving it, if anything appeared meanwhile


def durable_step(path: Optional[str], weights_only: bool = True) -> int:
    """The global step of a durable checkpoint in any format Lightning writes (the name's ``step=N``, our
    header, a local ``torch.save`` file, a sharded directory's commit marker: ``io.resolve.progress``);
    ``-1`` when there is no checkpoint or its step cannot be read. ``weights_only``: how a ``torch.save`` file
    is read (the user's ``fit(..., weights_only=...)``: ``format.legacy``)."""
    if not path:
        return -1
    try:
        found = resolve.progress(str(path), weights_only)
    except Exception:  # noqa: BLE001 - damage of any kind: the step is unknown, the memory snapshot decides
        return -1
    return -1 if found is None else found[0]


def durable_run(path: Optional[str], weights_only: bool = True) -> Optional[str]:
    """The memory-tier run id ``ExactResume`` wrote into the durable checkpoint at ``path``; ``None`` when
    there is no checkpoint, it holds none, or it cannot be read."""
    run = durable_value(path, RUN_KEY, weights_only)
    return run if isinstance(run, str) and run else None


def durable_value(path: Optional[str], key: str, weights_only: bool = True) -> Any:
    """The plain value at ``key`` of ``ExactResume``'s state in the durable checkpoint at ``path``; ``None``
    when there is no checkpoint, no such value, or it cannot be read."""
    if not path:
        return None
    try:
        return resolve.header_value(str(path), ("callbacks", "ExactResume", key), weights_only)
    except Exception:  # noqa: BLE001 - as above: no run id, so no memory snapshot is resumed
        return None


RUN_KEY = "memory_run"
"""Key of the run id in ``ExactResume``'s checkpoint state."""

ROOT_KEY = "memory_root_token"
"""Key of the fallback root's token (:func:`fallback_root`) in ``ExactResume``'s checkpoint state, when the run's
snapshots are not in this user's usual root because another user holds its name."""
