"""Recovery from peers at a relaunch, the mechanism: what a rank's memory holds, and moving a replica to its owner.

:func:`offer` checks this rank's own snapshot and the replicas it holds for other ranks, each verified (every
digest, and the record's run, rank and world size: ``MemoryStore.check``/``check_replica``, no tensor kept), and
describes them to the policy (``memory.recover``); what does not verify is warned, named in the offer, and never
used. :func:`carry_out` does this rank's part of a plan: the transfers, in the plan's order, each rank sending the
replicas it holds to their owners (``memory.transport``: streamed in bounded chunks from the file) and
receiving its own state, which it installs as its own snapshot (``MemoryStore.write_received``: private,
``O_EXCL|O_NOFOLLOW``, atomic rename), every digest checked as the bytes arrive, before the rename. A replica
holds the owner's bytes exactly, so the digests the owner wrote are the ones checked. Either way the state is
checked once; its tensors are read afterwards (``MemoryStore.load``, by ``memory.tier``) from the descriptor
they were checked through. Every problem becomes one line naming the ranks, the file and
the reason; the ranks' agreement on those lines is ``memory.tier``'s. Knows files and the transfer group, not
Lightning.
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
    for owner in owners:
        replica, refusals = _load(store, owner, store.replica_path(owner), lambda o=owner: store.check_replica(o, run))
        refused += refusals
        if replica is not None:  # verified a chunk at a time: no replica's tensors are held
            replicas.append(_held(owner, replica))
    mine = None if own is None else _held(store.rank, own)
    return own, RankOffer(store.rank, mine, tuple(replicas), tuple(refused), durable_step)


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


def _held(owner: int, snapshot: MemorySnapshot) -> Held:
    return Held(owner, snapshot.step, snapshot.seq, snapshot.saved_at, snapshot.path)


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
    if plan.sources[rank] == rank:
        return own, _check(own, plan, rank, store.path, f"rank {rank}'s snapshot")
    where = f"rank {rank}'s replica on rank {plan.sources[rank]} ({plan.paths[rank]})"
    try:
        received = store.check(run)  # checked as it arrived (``_receive``): its record, no second digest pass
    except _UNREADABLE as err:
        return None, [f"{where} failed verification after the transfer to {store.path}: {err}"]
    return received, _check(received, plan, rank, store.path, where)


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
    where = f"rank {owner}'s replica on rank {store.rank} ({store.replica_path(owner)})"
    try:
        fd = store.open_committed(replica_name(owner, store.world_size))  # through the slot's descriptor
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
