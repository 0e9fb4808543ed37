"""The snapshot schedule driven from a Lightning run: start it, decide at step boundaries, save, report.

At each optimizer-step boundary the ``SnapshotScheduler`` (``schedule.scheduler``) answers whether a
snapshot is due, with rank 0 deciding and every rank following through one small collective per
check, never per step; a preemption signal on any rank (``schedule.preemption``, a flag set by the
handler) asks for a durable snapshot and a clean stop. The snapshot goes where ``snapshots`` says,
its cost is measured (the blocking part only, for async writers) and its metrics go to the loggers.
"""

from __future__ import annotations

import signal
import time
from typing import Any, Callable, Mapping, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_resume import collective
from lightning_resume._compat import lightning as lc
from lightning_resume.errors import ExactResumeWarning
from lightning_resume.exact import snapshots
from lightning_resume.exact.launchers import requeue
from lightning_resume.exact.notices import REQUEUE, STOP, NoticeWatch, margin_metrics
from lightning_resume.memory.tier import MemoryTier
from lightning_resume.schedule import state as machine
from lightning_resume.schedule.config import ScheduleConfig
from lightning_resume.schedule.preemption import PreemptionFlag
from lightning_resume.schedule.scheduler import SnapshotScheduler
from lightning_resume.schedule.state import Tier
from lightning_resume.staging.lending import Offer
from lightning_resume.storage import files as storage

PREEMPTION = "preemption"


def make_scheduler(
    config: ScheduleConfig,
    clock: Optional[Callable[[], float]] = None,
    wall_clock: Optional[Callable[[], float]] = None,
    checks_needed: bool = False,
) -> Optional[SnapshotScheduler]:
    """The scheduler for ``config``, also without snapshots (``mtbf=None``, no step cap) when preemption
    signals need its cadence of rank-agreed checks (``checks_needed``); ``None`` when there is nothing to
    decide. ``clock`` (monotonic) and ``wall_clock`` (seconds since the epoch) default to ``time``'s."""
    if not (config.takes_snapshots or config.takes_memory_snapshots or checks_needed):
        return None
    return SnapshotScheduler(config, clock or time.monotonic, wall_clock or time.time)


def start(
    scheduler: SnapshotScheduler,
    trainer: pl.Trainer,
    num_nodes: Optional[int],
    pending: Mapping[str, Any],
    resumed_tier: Optional[str] = None,
    memory: Optional[MemoryTier] = None,
) -> None:
    """Begin timing; a resumed run keeps the measured costs of ``pending`` (the restored state) and records
    whether it resumed from the memory tier (a process failure), a peer's replica (a node loss) or from disk.
    With a ``memory`` tier the schedule takes its resolved replica count (three levels when it has replicas).
    The failure history lives in the checkpoints themselves, so no file of ours appears beside them
    (``fast_dev_run`` keeps none)."""
    quick = trainer.fast_dev_run  # type: ignore[attr-defined]  # set by Lightning's debugging connector
    scheduler.start(
        step=trainer.global_step,
        num_nodes=num_nodes or trainer.num_nodes,
        restored=pending.get("schedule"),
        checkpoint_wall_time=pending.get("saved_at"),
        resumed_tier=resumed_tier,
        keep_history=scheduler.takes_snapshots and not quick,
        replicas=None if memory is None else memory.replicas,
    )


def at_step_boundary(
    scheduler: SnapshotScheduler,
    preemption: Optional[PreemptionFlag],
    trainer: pl.Trainer,
    requeue_signal: Optional[signal.Signals] = None,
    memory: Optional[MemoryTier] = None,
    notices: Optional[NoticeWatch] = None,
) -> bool:
    """Save if the schedule, a preemption signal or a cloud notice says so; ``True`` when the run must stop
    (preempted): once the snapshot is durable, the handler the signal had before ours runs (Lightning's, a
    user's), else the run stops cleanly.

    One process acts on its own flag at once; ranks agree at check steps only (rank 0's decision,
    any rank's signal or notice), so no collective runs between checks. When any rank received
    ``requeue_signal`` (SLURM's, with ``auto_requeue``), rank 0 requeues the job once the snapshot is
    durable, as Lightning would have. A notice asks for ``STOP`` or, with ``on_notice="snapshot"`` (and for
    advisories), ``SNAPSHOT``: a durable snapshot, and training goes on. With a ``memory`` tier, the schedule
    picks the tier of each snapshot.
    """
    scheduler.step_ended(replica_activity(memory))  # the step that just ended is a C2 sample (replicas)
    local = 0
    if preemption is not None and preemption.requested:
        local = REQUEUE if requeue_signal is not None and preemption.received == requeue_signal else STOP
    if notices is not None:
        local = max(local, notices.level(scheduler.wall_clock(), _durable_cost(scheduler)))
    if local and trainer.world_size == 1:
        tier, preempt, reason = Tier.NONE, local, PREEMPTION
    else:
        device = trainer.strategy.root_device

        def agree(values: Any) -> list[int]:
            return collective.max_over_ranks(values, device)

        tier, preempt, reason = scheduler.decide(trainer.global_step, local, agree, trainer.is_global_zero)
    stop = preempt >= STOP
    if stop:
        scheduler.clean_stop()  # before the snapshot, which carries the history: a preemption is no failure
    noticed = preempt and notices is not None
    started = scheduler.wall_clock()
    save = tier is Tier.DURABLE or bool(preempt)
    before = memory.offer(trainer) if memory is not None and save else None
    path = snapshot(scheduler, trainer, PREEMPTION if preempt else reason, durable=bool(preempt)) if save else None
    if noticed:
        _log_notice_save(trainer, notices, started, scheduler.wall_clock(), stop)  # type: ignore[arg-type]
    if memory is not None and tier is not Tier.NONE and not preempt:
        # a durable save is also that step's memory snapshot: a crash right after it restores from memory; the
        # snapshot writes what that save staged on this rank (a new offer), instead of copying the state again
        offer = memory.offer(trainer) if save else None
        memory_snapshot(scheduler, trainer, memory, offer if offer is not before else None)
    if stop:
        rank_zero_info(
            f"ExactResume: preemption requested; snapshot at step {trainer.global_step} is durable; stopping."
        )
        # What the signal would have done without us now happens, one step late: Lightning's SIGTERM handler
        # (fit raises SIGTERMException) and a handler the user installed before it; else a clean stop.
        forwarded = preempt == STOP and preemption is not None and preemption.requested and preemption.forward()
        trainer.should_stop = trainer.should_stop or not forwarded
    if preempt == REQUEUE and path is not None:
        _requeue(trainer, path)
    scheduler.step_began(replica_activity(memory))  # our snapshots' blocking stays out of the next step's time
    return stop


def replica_activity(memory: Optional[MemoryTier]) -> Optional[tuple[int, bool]]:
    """The replicator's transfers now (begun, in flight), for timing the steps they overlap (C2); ``None``
    without one."""
    replicator = None if memory is None else memory.replicator
    return None if replicator is None else replicator.activity()


def _durable_cost(scheduler: SnapshotScheduler) -> Optional[float]:
    """Seconds from the start of a durable save to its durability, as measured so far (``None``: no save yet)."""
    state = scheduler.state
    if state is None or not state.costs:
        return None
    return machine.cost_estimate(state) + (state.last_write_s or 0.0)


def _log_notice_save(trainer: pl.Trainer, notices: NoticeWatch, started: float, durable: float, stop: bool) -> None:
    """Every rank: the save made for a notice, with the margin before the earliest deadline any rank saw (one
    collective, only at such a save); logged by rank 0. With ``on_notice="snapshot"`` the notice is done."""
    deadlines = collective.gather(notices.deadline)
    metrics = margin_metrics(deadlines, started, durable)
    if not stop:
        notices.snapshot_taken()
    if trainer.is_global_zero:
        margin = metrics.get("preemption_notice/margin_s")
        rank_zero_info(
            f"ExactResume: notice snapshot at step {trainer.global_step} durable after"
            f" {metrics['preemption_notice/save_s']:.2f} s"
            + ("" if margin is None else f", {margin:.1f} s before the deadline")
        )
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


def memory_snapshot(
    scheduler: SnapshotScheduler, trainer: pl.Trainer, memory: MemoryTier, borrow: Optional[Offer] = None
) -> None:
    """Snapshot into the memory tier now (every rank); its blocking time is the schedule's C1, except where it
    wrote a durable save's staging (``borrow``) instead of copying: that cost is not what a snapshot costs."""
    started = scheduler.clock()
    nbytes = memory.save(trainer, borrow, replicate=scheduler.replicate)
    blocked = scheduler.clock() - started
    replica_measured(scheduler, memory)
    if scheduler.state is None or nbytes is None or memory.borrowed_bytes:
        return
    metrics = scheduler.record_memory(trainer.global_step, blocked, nbytes)
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


def replica_measured(scheduler: SnapshotScheduler, memory: MemoryTier) -> None:
    """The schedule learns the newest replica transfer's time (D2; each transfer once), or that replication
    stopped (a replica did not fit a peer): two levels from then on."""
    replicator = memory.replicator
    if memory.replicas and (replicator is None or not replicator.enabled):
        scheduler.without_replicas()
    elif replicator is not None and replicator.last_transfer is not None:
        done = replicator.last_transfer
        scheduler.record_replica(done.seconds, (done.step, done.seq))


def _requeue(trainer: pl.Trainer, path: str) -> None:
    """Rank 0: make ``fit(ckpt_path=None)`` on SLURM find the snapshot too (Lightning's ``hpc_ckpt_N``), then
    requeue the job. Every rank waits for it, so no process exits before the job is requeued."""
    if trainer.is_global_zero:
        hpc_path = lc.hpc_save_path(trainer)
        try:
            snapshots.publish_as_hpc(path, hpc_path)
        except OSError as err:  # the snapshot itself is durable: requeue anyway
            rank_zero_warn(
                f"ExactResume: could not publish the snapshot as {hpc_path} ({err}); the requeued job resumes"
                " from it with fit(ckpt_path='last'), not with ckpt_path=None",
                category=ExactResumeWarning,
            )
        requeue()
    trainer.strategy.barrier("ExactResume.requeue")


def snapshot(scheduler: Optional[SnapshotScheduler], trainer: pl.Trainer, reason: str, durable: bool = False) -> str:
    """Save a snapshot now (every rank), account its cost, log its metrics (rank 0); with ``durable``, return
    only once an async write of it is durable (a preemption: the process is about to go).

    The cost is timed on the schedule's own clock, the one its intervals are measured on.
    """
    clock = scheduler.clock if scheduler is not None else time.monotonic
    started = clock()
    path = snapshots.save_snapshot(trainer, reason)
    blocked = clock() - started  # with an async writer: the snapshot part only
    writer = snapshots.async_writer(trainer)
    if (durable or reason == PREEMPTION) and writer is not None:
        snapshots.wait_durable(writer, path)
    if scheduler is None or scheduler.state is None:
        return path
    nbytes = storage.size(path) if trainer.is_global_zero else None  # a sharded directory: None
    metrics = scheduler.record(trainer.global_step, blocked, nbytes, writer)
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
    return path
