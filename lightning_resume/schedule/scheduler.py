"""Drive the snapshot schedule from a run: the clocks, the failure history, the preemption flag and
the rank-0 decision that every rank follows.

The decision itself is ``schedule.state.decide`` (pure); this module feeds it the clocks and the
measurements and keeps the run-time state (schedule state, next check step, failure history). Both
clocks are injected: the monotonic one (``clock``) times intervals and costs, the wall clock
(``wall_clock``, seconds since the epoch) dates the failure history, which spans processes. Ranks
agree through one small collective per check (``agree``, given by the caller), never per step.

``decide`` answers the tier of the snapshot due now (``Tier.MEMORY`` only with a memory tier,
``ScheduleConfig.takes_memory_snapshots``); the caller reports durable saves with ``record`` and
memory snapshots with ``record_memory``. A durable save also counts as that step's memory snapshot:
on ``Tier.DURABLE`` the mechanism should refresh the memory tier with the same state, and may report
that copy's cost with ``record_memory`` at the same step (it then only adds a C1 measurement).
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from typing import Callable, Hashable, Optional, Sequence

from lightning_resume.errors import HistoryWarning
from lightning_resume.protocols import AsyncCheckpointWriter
from lightning_resume.schedule import history
from lightning_resume.schedule import state as machine
from lightning_resume.schedule.config import MtbfMode, ScheduleConfig
from lightning_resume.schedule.metrics import memory_metrics, save_metrics
from lightning_resume.schedule.replica_cost import Activity, overlapped
from lightning_resume.schedule.state import Decision, MemoryState, SaveReason, ScheduleState, Tier

_TIER_CODES = (Tier.NONE, Tier.MEMORY, Tier.DURABLE)
"""Tiers as the integers ranks agree on (element-wise max: durable beats memory beats none)."""

HISTORY_KEY = "history"
"""Where the failure history sits in the schedule's state (inside each checkpoint's ExactResume entry)."""

CHECKPOINT_SOURCE = "the resumed checkpoint (ExactResume schedule state)"
"""How warnings name a history, or a snapshot time, read from the checkpoint resumed from."""

Agree = Callable[[Sequence[int]], Sequence[int]]
"""Element-wise max of small integer vectors over all ranks (identity on one process)."""


class SnapshotScheduler:
    """When to take the next snapshot, for one process of a run."""

    def __init__(
        self,
        config: ScheduleConfig,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.clock = clock
        self.wall_clock = wall_clock
        self.state: Optional[ScheduleState] = None
        self.memory: Optional[MemoryState] = None
        self.next_check_step = 0
        self.history: Optional[history.FailureHistory] = None  # this run's starts, saved in every checkpoint
        self.last_durable: Optional[float] = None
        self.replicate = False  # whether the snapshot decided last is sent to the peer nodes (all ranks agree)
        self._transfer: Optional[Hashable] = None  # the replica transfer recorded last
        self._step_began: Optional[tuple[float, Optional[Activity]]] = None  # (clock, replica activity) then
        self._writer: Optional[AsyncCheckpointWriter] = None

    @property
    def takes_snapshots(self) -> bool:
        """Whether this schedule ever saves on its own (else it only paces preemption checks)."""
        return self.config.takes_snapshots

    @property
    def takes_memory_snapshots(self) -> bool:
        """Whether this schedule ever takes memory-tier snapshots (a process MTBF or a memory step cap)."""
        return self.config.takes_memory_snapshots

    def start(
        self,
        step: int,
        num_nodes: int,
        restored: Optional[dict],
        checkpoint_wall_time: Optional[float],
        resumed_tier: Optional[str] = None,
        keep_history: bool = True,
        replicas: Optional[int] = None,
    ) -> None:
        """Begin timing at ``step``; with ``keep_history``, record this start in the failure history.

        The history travels inside the checkpoints (``state_dict()["history"]``): the one resumed from
        (``restored``) holds every earlier start, so no file is written beside the checkpoints.
        ``resumed_tier`` is the tier this start resumed from (``"memory"``, ``"replica"`` or
        ``"durable"``; ``None`` for a fresh start or when unknown): a failure resumed from memory is a
        process failure, from a replica a node loss. ``replicas``: the count the memory tier resolved (it
        replaces the option's; 0: the two-level schedule)."""
        config = self.config.with_nodes(num_nodes, replicas)
        mtbf = process_mtbf = None
        losses: tuple[Optional[float], Optional[float]] = (None, None)
        self.history = None
        if keep_history:
            tier = None if resumed_tier is None else Tier(resumed_tier)
            now = self.wall_clock()
            past = _past_history(restored)
            snapshot_time = _snapshot_time(checkpoint_wall_time, past, now)
            self.history = history.record_start(past, now, snapshot_time, tier=tier)
            mtbf, process_mtbf = _observed(config, self.history, now)
            losses = _observed_losses(config, self.history, now)
        schedule = {k: v for k, v in (restored or {}).items() if k != HISTORY_KEY} or None
        problems = machine.valid_restored(schedule or {})[1]
        if problems:  # a checkpoint is untrusted input: what it says wrongly is measured again, never a crash
            warnings.warn(
                "ExactResume: the checkpoint's schedule state is invalid, measured again: " + "; ".join(problems),
                HistoryWarning,
                stacklevel=2,
            )
        self.state, self.memory = machine.start(config, self.clock(), step, mtbf, process_mtbf, schedule, losses)
        self.next_check_step = step + 1
        self._step_began = None  # an earlier fit's last step boundary: the time since is no step

    def decide(self, step: int, preempt_local: int, agree: Agree, is_rank_zero: bool) -> tuple[Tier, int, str]:
        """(tier, preempt, reason) at a step boundary: rank 0's ``state.decide``, which every rank follows.

        One collective at check steps, none in between. ``preempt_local`` is this rank's preemption
        level (0: none; the caller's codes above 0); the answer is the highest level over all ranks.
        Rank 0's ``replicate`` travels in the same collective: :attr:`replicate` after the call."""
        self.replicate = False
        if self.state is None or step < self.next_check_step:
            return Tier.NONE, 0, SaveReason.NOT_DUE.value
        self.poll_write()
        decision = (
            machine.decide(self.state, self.memory, self.clock(), step)
            if is_rank_zero
            else Decision(Tier.NONE, SaveReason.NOT_DUE, 0)
        )
        code, next_check, preempt, replicate = agree(
            [_TIER_CODES.index(decision.tier), decision.next_check_step, int(preempt_local), int(decision.replicate)]
        )
        self.next_check_step = max(int(next_check), step + 1)
        self.replicate = bool(replicate)
        return _TIER_CODES[int(code)], int(preempt), decision.reason.value

    def record(
        self, step: int, blocked_s: float, nbytes: Optional[int], writer: Optional[AsyncCheckpointWriter] = None
    ) -> dict[str, float]:
        """Account a save whose blocking part ended now and took ``blocked_s``; return its metrics.

        With ``writer`` still writing it (async save), the write is timed by the writer and recorded
        by :meth:`poll_write` once durable; until then ``decide`` starts no new durable save.
        """
        assert self.state is not None
        now = self.clock()
        in_flight = writer is not None and writer.write_in_flight()
        write_s = None if in_flight else blocked_s
        self.state = machine.record_save(self.state, now, step, blocked_s, write_s=write_s)
        self._writer = writer if in_flight else None
        self.last_durable = self.last_durable if in_flight else now
        self.next_check_step = step + 1
        if self.memory is not None:
            self.memory = machine.record_durable_snapshot(self.memory, now, step)
        metrics = save_metrics(self.state, now, blocked_s, write_s, nbytes, self.last_durable, memory=self.memory)
        return _finite(metrics)

    def record_memory(self, step: int, blocked_s: float, nbytes: Optional[int]) -> dict[str, float]:
        """Account a memory snapshot whose blocking part ended now and took ``blocked_s`` (C1); return
        its metrics. At the step of a durable save just recorded it only adds the cost measurement."""
        assert self.state is not None and self.memory is not None, "record_memory needs a started memory tier"
        now = self.clock()
        self.memory = machine.record_memory_snapshot(self.memory, now, step, blocked_s)
        self.next_check_step = max(self.next_check_step, step + 1)
        return _finite(memory_metrics(self.state, self.memory, blocked_s, nbytes))

    def record_replica(self, seconds: float, transfer: Hashable = None) -> None:
        """Account a replica transfer that took ``seconds`` (D2, ``Replicator.last_transfer.seconds``), once:
        ``transfer`` names it (its step and seq), and the one recorded last is not recorded again."""
        if self.memory is None or (transfer is not None and transfer == self._transfer):
            return
        self._transfer = transfer
        self.memory = machine.record_replica_transfer(self.memory, seconds)

    def step_began(self, transfers: Optional[Activity]) -> None:
        """A training step begins now (after our hook, its snapshots included); ``transfers``: the replicator's
        activity now (``Replicator.activity()``; ``None`` without one)."""
        self._step_began = (self.clock(), transfers)

    def step_ended(self, transfers: Optional[Activity]) -> None:
        """The step begun at :meth:`step_began` ended now (before our hook): with replicas, its duration and the
        transfer it overlapped are a C2 sample (``replica_cost``). The first step of a process is not timed."""
        began, self._step_began = self._step_began, None
        if began is None or self.memory is None or self.state is None or not self.state.config.replicates:
            return
        seconds = max(0.0, self.clock() - began[0])
        self.memory = machine.record_step_time(self.memory, seconds, overlapped(began[1], transfers))

    def without_replicas(self) -> None:
        """The memory tier stopped replicating (a replica did not fit a peer): two levels from now on."""
        if self.state is None or not self.state.config.replicates:
            return
        config = self.state.config
        self.state = dataclasses.replace(self.state, config=config.with_nodes(config.num_nodes, 0))
        self.replicate = False

    def poll_write(self) -> bool:
        """If the async write recorded last has become durable, account it; ``True`` when it did now."""
        if self._writer is None or self.state is None or self._writer.write_in_flight():
            return False
        now = self.clock()
        self.state = machine.record_write_done(self.state, now, self._writer.last_write_seconds)
        self.last_durable, self._writer = now, None
        return True

    def clean_stop(self) -> None:
        """Record that this process stops on purpose (not a failure), for the checkpoints written after it
        (a preemption snapshot records it before it is written)."""
        if self.history is not None:
            self.history = history.record_clean_stop(self.history, self.wall_clock())

    def state_dict(self) -> dict:
        out = {} if self.state is None else machine.state_dict(self.state, self.memory)
        if self.history is not None:
            out[HISTORY_KEY] = history.history_to_json(self.history)
        return out


def _past_history(restored: Optional[dict]) -> history.FailureHistory:
    """The history the resumed checkpoint carries, else a fresh one. It is checked as untrusted input
    (``history.read_history``): a bad one warns and starts fresh."""
    if restored and HISTORY_KEY in restored:
        return history.read_history(restored[HISTORY_KEY], CHECKPOINT_SOURCE)
    return history.FailureHistory()


def _snapshot_time(value: Optional[float], past: history.FailureHistory, now: float) -> Optional[float]:
    """The resumed snapshot's wall time (``None``: a fresh start). One that is no wall time (the checkpoint's
    ``saved_at`` is untrusted too) warns and counts as taken when the previous life began: no uptime is
    credited to it, the conservative reading (a shorter M)."""
    if value is None or history.is_wall_time(value):
        return value
    warnings.warn(
        f"{CHECKPOINT_SOURCE}: saved_at is not a wall time (a finite number of seconds >= 0); the failure"
        " history records this start as if the snapshot was taken when the previous process started",
        HistoryWarning,
        stacklevel=4,
    )
    start = past.life_start()
    return now if start is None else start


def _observed(
    config: ScheduleConfig, past: history.FailureHistory, now: float
) -> tuple[Optional[float], Optional[float]]:
    """(M, M1) estimated from the history at wall time ``now`` where the config asks for observed
    values, else ``None``. With a memory tier, M (the node MTBF) counts node failures only; without
    one, every failure."""
    w = config.prior_weight
    mtbf = process_mtbf = None
    if config.mtbf_mode is MtbfMode.OBSERVED and config.job_mtbf_s is not None:
        estimate = history.estimate_node_mtbf if config.takes_memory_snapshots else history.estimate_mtbf
        mtbf = estimate(past, config.job_mtbf_s, w, now)
    if config.process_mtbf_mode is MtbfMode.OBSERVED and config.job_process_mtbf_s is not None:
        process_mtbf = history.estimate_process_mtbf(past, config.job_process_mtbf_s, w, now)
    return mtbf, process_mtbf


def _observed_losses(
    config: ScheduleConfig, past: history.FailureHistory, now: float
) -> tuple[Optional[float], Optional[float]]:
    """With replicas and ``mtbf="observed"``: (M2, M3), the job's node-loss and whole-job-loss MTBFs from
    the history (resumes from a replica; from the durable tier), each with its prior; else ``(None, None)``
    (the configured values)."""
    if not config.replicates or config.mtbf_mode is not MtbfMode.OBSERVED or config.job_mtbf_s is None:
        return None, None
    w = config.prior_weight
    node = history.estimate_node_loss_mtbf(past, config.job_mtbf_s, w, now)
    return node, history.estimate_job_loss_mtbf(past, config.job_loss_mtbf_s, w, now)


def _finite(metrics: dict) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if v is not None and math.isfinite(v)}
