"""Recovery from peers at a relaunch, the mechanism: what a rank's memory holds, and moving a replica to its owner.

:func:`offer` checks this rank's own snapshot and the replicas it holds for other ranks, each verified (every
digest, and the record's run, rank and world size: ``MemoryStore.check``/``check_replica``, no tensor kept), and
describes them to the policy (``memory.recover``), with the saves kept of either (``MemoryStore.kept``: checked by
header and record here, by every digest once used); what does not verify is warned, named in the offer, and never
used. :func:`carry_out` does this rank's part of a plan: the transfers, in the plan's order, each rank sending the
replicas it holds to their owners (``memory.transport``: streamed in bounded chunks from the file) and receiving
its own state, which it installs as its own snapshot (``MemoryStore.write_received``: private,
``O_EXCL|O_NOFOLLOW``, atomic rename), every digest checked as the bytes arrive, before the rename. A replica holds
the owner's bytes exactly, so the digests the owner wrote are the ones checked. A rank whose plan is a kept save of
its own makes it current again (``MemoryStore.reinstate``) and checks it. Either way the state is checked once; its
tensors are read afterwards (``MemoryStore.load``, by ``memory.tier``) from the descriptor they were checked
through. Every problem becomes one line naming the ranks, the file and the reason; the ranks' agreement on those
lines is ``memory.tier``'s. After any plan (:func:`settle`) the kept saves and the replicas newer than the plan go:
they belong to a line of training the run left, whose save numbers the resumed run will use again. Knows files and
the transfer group, not Lightning.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Iterable, Iterator, Optional

from lightning_resume.errors import CheckpointCorruptError, ExactResumeWarning, ReplicaTransferError
from lightning_resume.memory import transport
from lightning_resume.memory.recover import Held, RankOffer, RecoveryPlan, Refused
from lightning_resume.memory.replicate import ACK_TAG
from lightning_resume.memory.store import MemorySnapshot, MemoryStore, replica_name

RECOVERY_TAG = max(transport.FILE_TAG, ACK_TAG) + 1
"""Tag of the recovery transfers on the transfer group: apart from replication's files and acknowledgements (its
threads start after recovery, at train start; a previous fit's in the same process have stopped)."""

_UNREADABLE = (CheckpointCorruptError, OSError, ValueError)
"""What a damaged, foreign or vanished snapshot raises when it is loaded (``ReplicaTransferError`` is an OSError)."""


def offer(
    store: MemoryStore, run: str, owners: Iterable[int], durable_step: int
) -> tuple[Optional[MemorySnapshot], RankOffer]:
    """This rank's own verified snapshot of ``run`` (``MemoryStore.check``: every digest read a chunk at a time, no
    tensor kept, the file kept open for the load that follows the plan) and its offer: that snapshot's record, the
    records of the verified replicas it holds of ``owners`` (``check_replica``, likewise), the ones refused, and
    ``durable_step``."""
    own, refused = _load(store, store.rank, store.path, lambda: store.check(run))  # checked once: not again
    replicas = []
    owners = list(owners)
    for owner in owners:
        replica, refusals = _load(store, owner, store.replica_path(owner), lambda o=owner: store.check_replica(o, run))
        refused += refusals
        if replica is not None:  # verified a chunk at a time: no replica's tensors are held
            replicas.append(_held(owner, replica, replica_name(owner, store.world_size)))
    mine = None if own is None else _held(store.rank, own, store.name)
    kept = _kept(store, run, owners, [h for h in [mine, *replicas] if h is not None], refused)
    return own, RankOffer(store.rank, mine, tuple(replicas), tuple(refused), durable_step, kept)


def _kept(
    store: MemoryStore, run: str, owners: list[int], current: list[Held], refused: list[Refused]
) -> tuple[Held, ...]:
    """The kept saves of this rank's snapshot and of the replicas of ``owners``, by header and record (every digest is
    checked when one is used); a keep of the save its current file holds is that file: not offered twice."""
    offered = {(h.owner, h.seq) for h in current}
    kept = []
    try:
        found = store.kept(owners)
    except _UNREADABLE:  # a slot that cannot be trusted or read: the own snapshot's refusal already said so
        return ()
    for k in found:
        if (k.owner, k.seq) in offered:
            continue
        snapshot, refusals = _load(
            store, k.owner, os.path.join(store.directory, k.name), lambda k=k: store.check_kept(k, run)
        )
        refused += refusals
        if snapshot is not None:
            kept.append(_held(k.owner, snapshot, k.name, kept=True))
    return tuple(kept)


def _load(store: MemoryStore, owner: int, path: str, load: Any) -> tuple[Optional[MemorySnapshot], list[Refused]]:
    try:
        return load(), []
    except _UNREADABLE as err:
        kind = "snapshot" if owner == store.rank else f"replica of rank {owner}"
        warnings.warn(
            f"ExactResume: skipping the memory-tier {kind} {path} on rank {store.rank}: {err}",
            ExactResumeWarning,
            stacklevel=3,
        )
        return None, [Refused(owner, path, str(err))]


def _held(owner: int, snapshot: MemorySnapshot, name: str, kept: bool = False) -> Held:
    return Held(owner, snapshot.step, snapshot.seq, snapshot.saved_at, snapshot.path, name, kept)


def carry_out(
    plan: RecoveryPlan, store: MemoryStore, group: Any, run: str, own: Optional[MemorySnapshot]
) -> tuple[Optional[MemorySnapshot], list[str]]:
    """This rank's part of ``plan``: every transfer it takes part in, in the plan's order (so both ranks of each
    reach it together), then its own state of the plan's save, verified; the problems, one line each.
    ``own``: this rank's own snapshot (used when the plan says so; dropped before a transfer replaces it)."""
    rank, problems = store.rank, []
    if plan.sources[rank] != rank:
        own = None  # replaced by what arrives: never two states of this rank in memory
    for holder, owner in plan.transfers:
        if holder == rank:
            problems += _send(store, owner, group, plan)
        elif owner == rank:
            problems += _receive(store, holder, group, plan)
    if problems:
        return None, problems
    if plan.sources[rank] == rank and rank in plan.kept:
        return _reinstate(store, plan, run)
    if plan.sources[rank] == rank:
        return own, _check(own, plan, rank, store.path, f"rank {rank}'s snapshot")
    where = f"rank {rank}'s replica on rank {plan.sources[rank]} ({plan.paths[rank]})"
    try:
        received = store.check(run)  # checked as it arrived (``_receive``): its record, no second digest pass
    except _UNREADABLE as err:
        return None, [f"{where} failed verification after the transfer to {store.path}: {err}"]
    return received, _check(received, plan, rank, store.path, where)


def _reinstate(store: MemoryStore, plan: RecoveryPlan, run: str) -> tuple[Optional[MemorySnapshot], list[str]]:
    """This rank's kept save of the plan made its current snapshot again, then checked, every digest (the offer read
    only its header); ``memory.tier`` then reads it from the descriptor it was checked through."""
    rank, where = store.rank, f"rank {store.rank}'s kept snapshot {plan.paths[store.rank]}"
    try:
        store.reinstate(plan.names[rank])
        snapshot = store.check(run)
    except _UNREADABLE as err:
        return None, [f"{where} could not be made current or failed verification: {err}"]
    return snapshot, _check(snapshot, plan, rank, store.path, where)


def settle(store: MemoryStore, plan: RecoveryPlan, offered: RankOffer, owners: Iterable[int]) -> None:
    """After ``plan`` (every rank): drop the kept saves of this rank and of the replicas of ``owners``, and the replicas
    newer than the plan (a line of training the run left: the resumed run numbers its saves from the plan's again).
    The run keeps the plan's save in every rank's own file; the next complete replicated save is the next anchor."""
    try:
        store.prune(None, owners)
        store.discard([held.name for held in offered.replicas if held.seq > plan.seq])
    except OSError as err:  # the resume goes on: said, as a file the next recovery must not offer
        message = f"ExactResume: the memory tier could not drop the kept saves in {store.directory}: {err}"
        warnings.warn(message, ExactResumeWarning, stacklevel=2)


def _check(snapshot: Optional[MemorySnapshot], plan: RecoveryPlan, rank: int, path: str, what: str) -> list[str]:
    if snapshot is None:
        return [f"{what} is gone from {path}"]
    if (snapshot.step, snapshot.seq) != (plan.step, plan.seq):
        return [
            f"{what} at {path} is of step {snapshot.step} (save {snapshot.seq}), not of step {plan.step}"
            f" (save {plan.seq})"
        ]
    return []


def _send(store: MemoryStore, owner: int, group: Any, plan: RecoveryPlan) -> list[str]:
    where = f"rank {owner}'s replica on rank {store.rank} ({plan.paths[owner] or store.replica_path(owner)})"
    try:
        name = plan.names[owner] if plan.names else replica_name(owner, store.world_size)  # its replica, or a kept one
        fd = store.open_committed(name)  # through the slot's descriptor
    except OSError as err:
        fd, problem = None, f"{where} could not be opened: {err}"
    else:
        problem = f"{where} is gone" if fd is None else ""
    if fd is None:  # before anything went out: the owner is told "nothing", so both calls complete
        transport.send_nothing(owner, group, tag=RECOVERY_TAG)
        return [problem]
    try:
        transport.send_file(fd, owner, group, record=(plan.step, plan.seq), tag=RECOVERY_TAG)
    except ReplicaTransferError as err:  # the stream broke: the receiver sees it too
        return [f"{where} could not be sent: {err}"]
    except (OSError, ValueError) as err:  # mapping it failed, before the header: the owner is told "nothing"
        transport.send_nothing(owner, group, tag=RECOVERY_TAG)
        return [f"{where} could not be read: {err}"]
    finally:
        os.close(fd)
    return []


def _receive(store: MemoryStore, holder: int, group: Any, plan: RecoveryPlan) -> list[str]:
    rank = store.rank
    where = f"rank {rank}'s replica on rank {holder} ({plan.paths[rank]})"

    def install(nbytes: int, chunks: Iterator[memoryview]) -> str:
        return store.write_received(store.name, nbytes, chunks, verify=True)  # every digest, before the rename

    try:
        written = transport.recv_file(holder, group, install, tag=RECOVERY_TAG)
    except CheckpointCorruptError as err:  # a digest or the size: refused before the rename, nothing installed
        return [f"{where} failed verification on arrival in {store.path}: {err}"]
    except _UNREADABLE as err:
        return [f"{where} did not arrive whole in {store.path}: {err}"]
    return [] if written is not None else [f"{where} was not sent"]
