"""In-training replication: each committed memory snapshot goes to the ranks that hold its replicas, in the
background, and the replicas of other ranks arrive here and are written as snapshots are.

One sender thread per rank: a snapshot's commit (on the store's writer thread, ``MemoryStore.save(after_commit=)``)
hands it over open (:meth:`Replicator.offer`) and returns at once; the sender sends it to each holder in turn
(``memory.transport``), and each holder answers with a small acknowledgement (stored, or refused with the sizes).
While a transfer is in flight a newer snapshot replaces the pending one (coalesced): never more than one
waits, and no training step ever waits for a transfer. One receiver thread per rank whose replicas this rank
holds writes each arriving file with ``MemoryStore.write_received``. A holder whose memory tier cannot fit a
replica refuses it (nothing is written): the owner warns once, naming the sizes and the fix, and stops
replicating for the run; its local snapshots go on.

The saves replicated are agreed at each one (:func:`agree`, ``memory.anchor``): only when no rank's replicator is
busy, so every rank sends the same saves, and coalescing never drops one on a rank only. Each such save is kept
(``MemoryStore.keep``: a hard link) by its owner at its commit and by each holder as it arrives, and the kept saves
older than the anchor (the oldest save every rank's holders acknowledged) go: a node lost while a newer save is
in transit finds a complete set at the anchor (``memory.recover``).

Shutdown (:meth:`Replicator.stop`): the sender finishes the transfer in flight, drops what is pending and
sends every holder "nothing", on which each holder's receiver ends; the receivers here end when their
owners do the same. Every wait is bounded: a peer that is gone breaks its connection (the thread ends
with a warning), one that hangs is left behind after the timeout, warned, on a daemon thread. Nothing here
can lose a local snapshot. Knows threads, the store and the transport; not Lightning.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_resume.collective import gather
from lightning_resume.errors import ExactResumeWarning, ReplicaTransferError, byte_size
from lightning_resume.memory import topology, transport
from lightning_resume.memory.anchor import Gate, Vote, decide
from lightning_resume.memory.store import Committed, MemoryStore, NotEnoughSharedMemory, replica_name
from lightning_resume.threads import lower_thread_priority

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 60.0
"""How long :meth:`Replicator.stop` waits for the transfer in flight and for the peers' last word."""

QUIET_STOP_TIMEOUT_S = 5.0
"""The same after an exception, when the peers are still training and will not say their last word soon."""

ACK_TAG = transport.FILE_TAG + 1
"""Tag of a holder's acknowledgement, so it never meets the files going the other way between the same two ranks."""

STORED, REFUSED, FAILED = 0, 1, 2
"""A holder's answer to one replica: written; did not fit (sizes follow); could not be written (warned there)."""


@dataclass(frozen=True)
class TransferStats:
    """The newest snapshot sent to every holder: its size, the time from the first byte to the last holder's
    acknowledgement (the measured C2 of the three-level schedule), and which snapshot it was."""

    nbytes: int
    seconds: float
    step: int
    seq: int


@dataclass
class _Pending:
    fd: int
    step: int
    seq: int


class Replicator:
    """Send this rank's committed snapshots to ``holders`` and receive the replicas of ``owners`` (global
    ranks, ``memory.topology``) over ``group`` (``transport.transfer_group``), each on a daemon thread."""

    def __init__(
        self, store: MemoryStore, group: Any, holders: Sequence[int], owners: Sequence[int], node: int = -1
    ) -> None:
        self.store, self.group, self.node = store, group, node  # node: ranks of one node share its free space
        self.holders, self.owners = list(holders), list(owners)
        self.enabled = bool(self.holders)
        self.last_transfer: Optional[TransferStats] = None
        self.sent = 0  # snapshots sent to every holder
        self.received = 0  # replicas written here
        self.begun = 0  # transfers begun (each snapshot sent to every holder is one)
        self.in_flight = False  # whether a transfer is being sent now
        self.acked: set[int] = set()  # own saves every holder stored and kept, at or after the anchor (memory.anchor)
        self._kept_own: set[int] = set()  # own saves kept here (a keep of the committed file)
        self.keeping = False  # whether committed snapshots and arriving replicas are kept (the gate, :func:`agree`)
        self.anchor: Optional[int] = None  # the newest gate's: kept saves below it are gone (``None``: none kept)
        self._warned_room = False
        self._pending: Optional[_Pending] = None
        self._changed = threading.Condition()
        self._stopping = False
        self._stopping_by_force = False  # the group was cut: the errors it causes are not news
        self._sender = threading.Thread(target=self._send_loop, name="lightning-resume-replica-send", daemon=True)
        self._receivers = [
            threading.Thread(target=self._receive_loop, args=(o,), name=f"lightning-resume-replica-{o}", daemon=True)
            for o in self.owners
        ]
        self._started = False
        self._failed_owners: set[int] = set()  # owners whose replica could not be written here (warned once)

    def start(self) -> None:
        """Start the sender and the receivers (every rank, once the group exists)."""
        if not self._started:
            self._started = True
            for thread in (self._sender, *self._receivers):
                thread.start()

    def activity(self) -> tuple[int, bool]:
        """(transfers begun, one in flight now), read together: what the schedule times the steps against (C2,
        ``schedule.replica_cost``)."""
        with self._changed:
            return self.begun, self.in_flight

    def offer(self, fd: int, step: int, seq: int) -> None:
        """A snapshot just committed, open as ``fd`` (taken: closed here or once sent): send it next, replacing
        one still waiting (coalesced). Returns at once; on the store's writer thread."""
        if self.keeping and self._keep(self.store.name, seq):
            self._kept_own.add(seq)
        with self._changed:
            if not self.enabled or self._stopping:
                os.close(fd)
                return
            dropped, self._pending = self._pending, _Pending(fd, step, seq)
            self._changed.notify_all()
        if dropped is not None:
            os.close(dropped.fd)

    def _next(self) -> Optional[_Pending]:
        with self._changed:
            while self._pending is None and not self._stopping:
                self._changed.wait()
            pending, self._pending = self._pending, None
            return None if self._stopping and pending is None else pending

    def _send_loop(self) -> None:
        lower_thread_priority()  # as the snapshot's writer: training's threads get the cores first
        try:
            going = True
            while going and (pending := self._next()) is not None:
                self._in_flight(True)
                try:
                    going = self._send(pending)
                finally:
                    self._in_flight(False)
                    os.close(pending.fd)
            self._say_nothing()  # the holders' receivers end on it
        except ReplicaTransferError as err:
            if self._stopping_by_force:
                return
            self._disable(f"replication stopped ({err}); the local memory tier stays on")
            self._say_nothing(but=err.peer)  # the other holders' receivers still end
        except Exception as err:  # noqa: BLE001 - a daemon thread: reported, never raised into training
            self._disable(f"replica sender failed ({type(err).__name__}: {err}); replication is off for this run")

    def _in_flight(self, now: bool) -> None:
        with self._changed:
            self.begun += int(now)
            self.in_flight = now

    def _send(self, pending: _Pending) -> bool:
        """Send one snapshot to every holder; ``False`` when replication ends (a holder refused it)."""
        started = time.monotonic()
        nbytes = 0
        for holder in self.holders:
            nbytes = transport.send_file(pending.fd, holder, self.group, record=(pending.seq, pending.step))
            status, needed, free = _receive_ack(holder, self.group)
            if status == REFUSED:
                self._disable(
                    f"rank {self.store.rank}'s replica ({byte_size(needed)}) does not fit the memory tier of rank"
                    f" {holder} ({byte_size(free)} free); replication is off for this run, the local memory tier"
                    " stays on. Fix: a larger tmpfs on that node (`mount -o remount,size=XXG /dev/shm`, or"
                    " `--shm-size` for Docker), MemoryTierOptions(dir=...) on a larger one, or"
                    " MemoryTierOptions(replicas=0)"
                )
                return False
            if status == FAILED:
                return True  # said on the holder; the next snapshot tries again
        self.sent += 1
        with self._changed:
            if pending.seq in self._kept_own:  # kept here and, each holder said so, there: part of a complete set
                self.acked.add(pending.seq)
        self.last_transfer = TransferStats(nbytes, time.monotonic() - started, pending.step, pending.seq)
        return True

    def _say_nothing(self, but: Optional[int] = None) -> None:
        """Tell every holder (``but`` the one whose connection failed) that nothing more comes: its receiver ends."""
        for holder in self.holders:
            if holder != but:
                try:
                    transport.send_nothing(holder, self.group)
                except ReplicaTransferError as err:
                    log.debug("memory tier: could not tell rank %d that replication ends: %s", holder, err)

    def _receive_loop(self, owner: int) -> None:
        lower_thread_priority()
        buffer = torch.empty(transport.CHUNK, dtype=torch.uint8)  # pages only where a chunk is received
        try:
            while (answer := transport.recv_file(owner, self.group, self._sink(owner), buffer)) is not None:
                _send_ack(owner, self.group, answer)
        except ReplicaTransferError as err:
            if not self._stopping_by_force:
                _warn(f"ExactResume: no more replicas of rank {owner} this run: {err}")
        except Exception as err:  # noqa: BLE001 - a daemon thread: reported, never raised into training
            _warn(f"ExactResume: receiving rank {owner}'s replicas failed ({type(err).__name__}: {err})")

    def _sink(self, owner: int) -> Any:
        name = replica_name(owner, self.store.world_size)

        def write(nbytes: int, chunks: Any) -> tuple[int, int, int]:
            try:
                self.store.write_received(name, nbytes, chunks)
                if self.keeping and not self._keep(name, chunks.record[0]):  # an acknowledged save is kept
                    return FAILED, nbytes, 0  # stored but not kept: no anchor may count on it
            except NotEnoughSharedMemory as err:
                return REFUSED, err.needed, err.free  # the owner says it, once
            except OSError as err:
                if owner not in self._failed_owners:  # said once; each later snapshot tries again
                    self._failed_owners.add(owner)
                    _warn(f"ExactResume: rank {owner}'s replica could not be written to {self.store.directory}: {err}")
                return FAILED, nbytes, 0
            self.received += 1
            return STORED, nbytes, 0

        return write

    def _keep(self, name: str, seq: int) -> bool:
        """Keep save ``seq`` of the committed file ``name``; whether it is kept."""
        try:
            self.store.keep(name, seq)
        except OSError as err:  # the file is committed; without its keep the anchor stays older
            log.warning("memory tier: could not keep save %d of %s: %s", seq, name, err)
            return False
        return True

    def vote(self) -> Vote:
        """This rank's word at a replicated save (``memory.anchor``); the previous snapshot committed and handed
        over first (:func:`agree`), so that its transfer counts as busy."""
        try:
            pinned, free = self.store.footprint(self.owners)
        except OSError:  # the slot is not usable: the save says so, after the collective every rank takes part in
            pinned, free = 0, 0
        with self._changed:
            busy = self.in_flight or self._pending is not None
            return Vote(self.enabled, busy, frozenset(self.acked), pinned, free, self.node)

    def apply(self, gate: Gate) -> None:
        """Keep this save and the replicas arriving while there is an anchor, and drop the kept saves below it (all of
        them without one: said once, with the sizes, by rank 0)."""
        self.keeping, self.anchor = gate.anchor is not None, gate.anchor
        with self._changed:  # the saves below the anchor, or all without one, are no longer kept
            below = -1 if gate.anchor is None else gate.anchor
            self.acked = {s for s in self.acked if gate.anchor is not None and s >= below}
            self._kept_own = {s for s in self._kept_own if gate.anchor is not None and s >= below}
        self.store.prune(gate.anchor, self.owners)
        if gate.short is not None and not self._warned_room:
            self._warned_room = True
            rank, needed, free = gate.short
            if self.store.rank == 0:
                _warn(
                    f"ExactResume: the memory tier of rank {rank}'s node has {byte_size(free)} free, less than the"
                    f" {byte_size(needed)} that keeping the newest replicated save of its ranks needs; no save is"
                    " kept, so a node"
                    " lost while a replica is in transit resumes from the durable tier. Fix: a larger tmpfs"
                    " (`mount -o remount,size=XXG /dev/shm`, or `--shm-size` for Docker) or"
                    " MemoryTierOptions(dir=...) on a larger one"
                )

    def _disable(self, message: str) -> None:
        with self._changed:
            was, self.enabled = self.enabled, False
            dropped, self._pending = self._pending, None
        if dropped is not None:
            os.close(dropped.fd)
        if was:
            _warn(f"ExactResume: {message}")

    def stop(self, timeout: float = STOP_TIMEOUT_S, quiet: bool = False) -> bool:
        """End replication: the transfer in flight finishes, a pending snapshot is dropped, every holder hears
        "nothing", and the replicas owed to this rank end as their owners stop (``quiet``, after an exception:
        they are not waited for, the peers still train). A thread still waiting after ``timeout`` seconds (or,
        ``quiet``, a receiver at all) is cut off by closing the group (``transport.break_group``): no thread may
        wait in gloo when the interpreter exits. ``False`` when one had to be cut (warned unless ``quiet``).
        Idempotent."""
        with self._changed:
            self._stopping = True
            dropped, self._pending = self._pending, None
            self._changed.notify_all()
        if dropped is not None:
            os.close(dropped.fd)
        if not self._started:
            return True
        deadline = time.monotonic() + timeout
        self._sender.join(timeout)  # it tells the holders "nothing"
        for thread in [] if quiet else self._receivers:  # they end as their owners stop
            thread.join(max(0.0, deadline - time.monotonic()))
        left = [t.name for t in (self._sender, *self._receivers) if t.is_alive()]
        if left:
            self._stopping_by_force = True
            transport.break_group(self.group)  # no thread may still wait in gloo when the interpreter exits
            for thread in (self._sender, *self._receivers):
                thread.join(QUIET_STOP_TIMEOUT_S)
        if left and not quiet:
            _warn(
                f"ExactResume: replica transfers {left} did not end within {timeout:.0f}s of the end of training"
                " (a peer rank hangs or ended without a word); they were cut, the local memory tier is unaffected"
            )
        return not left


def _send_ack(owner: int, group: Any, answer: tuple[int, int, int]) -> None:
    try:
        dist.send(torch.tensor(answer, dtype=torch.int64), owner, group=group, tag=ACK_TAG)
    except RuntimeError as err:
        raise ReplicaTransferError(owner, f"the acknowledgement could not be sent: {err}") from err


def _receive_ack(holder: int, group: Any) -> tuple[int, int, int]:
    ack = torch.zeros(3, dtype=torch.int64)
    try:
        dist.recv(ack, holder, group=group, tag=ACK_TAG)
    except RuntimeError as err:
        raise ReplicaTransferError(holder, f"no acknowledgement came: {err}") from err
    status, needed, free = (int(x) for x in ack.tolist())
    return status, needed, free


def _warn(message: str) -> None:
    warnings.warn(message, ExactResumeWarning, stacklevel=2)


@dataclass(frozen=True)
class Ring:
    """One run's replication: the resolved count, this rank's holders and the owners whose replicas it holds
    (``memory.topology``), the transfer group (``None`` without replicas), and this rank's node (``-1``: unknown)."""

    replicas: int = 0
    holders: tuple[int, ...] = ()
    owners: tuple[int, ...] = ()
    group: Any = None
    node: int = -1


def ring(
    option: Optional[int],
    num_nodes: int,
    rank: int,
    world_size: int,
    previous: Ring = Ring(),
    node_rank: Optional[int] = None,
) -> Ring:
    """Every rank, at setup: the replication of a run on ``num_nodes`` nodes (``ConfigurationError`` for a replica
    count no ring can place). The transfer group is made here, collectively, when there are replicas; the one
    of ``previous`` (an earlier fit's) is destroyed first. ``node_rank``: this rank's node as the launcher says
    (gathered from every rank: the ring follows where ranks run, ``topology.placed``); ``None``: node by node."""
    replicas = topology.resolve_replicas(option, num_nodes)
    if previous.group is not None:  # an earlier fit's, perhaps cut at its end (transport.break_group)
        dist.destroy_process_group(previous.group)
    if replicas == 0:
        return Ring()
    group = transport.transfer_group()
    order = list(range(world_size)) if node_rank is None else topology.placed(gather(node_rank), num_nodes)
    place = order.index(rank)
    holders = [order[h] for h in topology.replica_holders(place, world_size, num_nodes, replicas)]
    owners = [order[o] for o in topology.replicas_held(place, world_size, num_nodes, replicas)]
    return Ring(replicas, tuple(holders), tuple(owners), group, place // (world_size // num_nodes))


def start(store: Optional[MemoryStore], plan: Ring) -> Optional[Replicator]:
    """The replicator of this fit, started (every rank, at train start); ``None`` without replicas."""
    if store is None or plan.replicas == 0:
        return None
    replicator = Replicator(store, plan.group, plan.holders, plan.owners, plan.node)
    replicator.start()
    return replicator


def stop(replicator: Optional[Replicator], quiet: bool = False) -> None:
    """Stop ``replicator`` (:meth:`Replicator.stop`; ``quiet``: after an exception, briefly and without a word)."""
    if replicator is not None:
        replicator.stop(QUIET_STOP_TIMEOUT_S if quiet else STOP_TIMEOUT_S, quiet)


def agree(replicator: Replicator) -> bool:
    """Every rank, before a memory snapshot the schedule replicates (one small collective on the training group):
    whether it is replicated (no rank's replicator busy, ``memory.anchor``); the anchor's kept saves are settled."""
    failed: Optional[OSError] = None
    try:
        replicator.store.wait()  # the previous snapshot committed and handed over: its transfer is counted
    except OSError as err:  # its write failed: raised once every rank has voted (no rank waits alone)
        failed = err
    gate = decide(gather(replicator.vote()))
    replicator.apply(gate)
    if failed is not None:
        raise failed
    return gate.replicate


def after_commit(replicator: Optional[Replicator]) -> Optional[Committed]:
    """What a snapshot's commit hands itself to: the replicator, while it replicates."""
    return replicator.offer if replicator is not None and replicator.enabled else None
