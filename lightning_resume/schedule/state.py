"""The schedule state machine: when to snapshot, and to which tier.

A frozen ``ScheduleState`` (the durable tier) and, with a memory tier, a frozen ``MemoryState``,
replaced by pure functions: ``start`` at the start of a process, ``decide`` at a check (the one
answer to "snapshot now, and to which tier?": ``Tier.NONE``, ``Tier.MEMORY`` or ``Tier.DURABLE``),
``record_save`` / ``record_write_done`` / ``record_memory_snapshot`` / ``record_durable_snapshot``
after. The clock is always passed in (``now``, seconds of a monotonic clock) and measurements arrive
as arguments; the formulas are ``formulas``', the options ``config``'s. It must not import Lightning,
read a clock, touch files or talk to other ranks: the scheduler asks ``decide`` on rank 0 and
broadcasts its answer.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping, Optional

from lightning_resume.schedule.config import ScheduleConfig
from lightning_resume.schedule.formulas import (
    Levels,
    ThreeLevelPlan,
    TwoLevelPlan,
    expected_waste,
    optimal_interval,
    three_level_k,
    three_level_plan,
    three_level_waste,
    two_level_plan,
    two_level_waste,
    young_interval,
)
from lightning_resume.schedule.replica_cost import StepTimes, record_step, transfer_cost

COST_WINDOW = 5
"""How many recent blocking costs the C estimate is the median of (robust to one slow first save)."""

REPLICA_STEP_OVERHEAD = 0.03
"""C2's prior, the training time a replica transfer costs, as a fraction of its duration D2: it runs in the
background and only slows the steps it overlaps; the issue's bound on that slowdown is 3 % (steps while a replica
is in flight <= 1.03x calm ones). Used until C2 is measured from the run's own step times (``replica_cost``).
The memory snapshot's own blocking part, handing the snapshot to the replicator included, is measured in C1."""


class SaveReason(str, Enum):
    """Why ``decide`` answered as it did (logged, and handy in tests)."""

    FIRST_MEASUREMENT = "first_measurement"  # no C measured yet: save early to measure it
    INTERVAL = "interval"  # T* has elapsed since the last save
    STEP_CAP = "step_cap"  # every_n_train_steps_max steps have passed since the last save
    NOT_DUE = "not_due"
    WRITE_IN_FLIGHT = "write_in_flight"  # due (or not), but the previous async write is not durable yet
    OFF = "off"  # mtbf=None and no step cap
    MEMORY_FIRST_MEASUREMENT = "memory_first_measurement"  # no C1 measured yet: snapshot early to measure it
    MEMORY_INTERVAL = "memory_interval"  # T1 has elapsed since the last snapshot of either tier
    MEMORY_STEP_CAP = "memory_step_cap"  # memory_every_n_train_steps_max steps since the last snapshot
    EVERY_KTH = "every_kth"  # the memory snapshot due now is the k-th since the last durable save: durable
    MAX_INTERVAL = "max_interval"  # max_interval has passed since the last durable save


class Tier(str, Enum):
    """Where a snapshot goes: nowhere, the memory tier (survives a crashed process, not a lost node) or
    the durable tier (disk or object store; survives anything). ``REPLICA`` names a resume source only:
    the memory tier's snapshot as a peer node held it (the rank's own node was lost)."""

    NONE = "none"
    MEMORY = "memory"
    DURABLE = "durable"
    REPLICA = "replica"  # a resume source only (a memory snapshot as a peer node held it); never a decision


@dataclass(frozen=True)
class Decision:
    """Rank 0's answer at a check: which tier to snapshot to now (``Tier.NONE``: none), why, and the
    step of the next check.

    Between checks the scheduler needs no collective; ``next_check_step`` (> the current step) is
    broadcast together with ``tier`` so every rank checks at the same step. ``replicate``: whether the
    memory snapshot taken now (also the one a durable save refreshes) is sent to the peer nodes.
    """

    tier: Tier
    reason: SaveReason
    next_check_step: int
    replicate: bool = False


@dataclass(frozen=True)
class ScheduleState:
    """Everything the schedule remembers; replaced, never mutated.

    ``anchor_time`` / ``anchor_step``: when the interval being timed began (the end of the last
    save's blocking part, or the start of this process). ``costs``: recent measured blocking
    times, newest last. ``write_started_at`` is set while an async write is in flight.
    """

    config: ScheduleConfig
    mtbf_s: Optional[float]
    anchor_time: float
    anchor_step: int
    costs: tuple = ()
    last_write_s: Optional[float] = None
    write_started_at: Optional[float] = None
    saves: int = 0


@dataclass(frozen=True)
class MemoryState:
    """What the memory tier's schedule remembers, next to the durable ``ScheduleState``.

    ``process_mtbf_s``: the job's M1 (``None``: no process MTBF, only a step cap paces the tier).
    ``anchor_time`` / ``anchor_step``: the end of the newest snapshot of *either* tier (a durable
    save is also that step's memory snapshot). ``costs``: recent measured C1, newest last.
    ``since_durable``: memory snapshots since the newest durable save; ``durable_step``: that save's
    step (``None`` before the first one of this process).
    With replicas (``ScheduleConfig.replicates``): ``node_mtbf_s`` / ``job_loss_mtbf_s``, the job's M2
    (node losses) and M3 (whole-job losses), ``replica_costs``, recent measured transfer times D2, and
    ``step_times``, the step durations with the transfers they overlapped (C2, ``replica_cost``).
    """

    process_mtbf_s: Optional[float]
    anchor_time: float
    anchor_step: int
    costs: tuple = ()
    since_durable: int = 0
    durable_step: Optional[int] = None
    snapshots: int = 0
    node_mtbf_s: Optional[float] = None
    job_loss_mtbf_s: Optional[float] = None
    replica_costs: tuple = ()
    step_times: StepTimes = StepTimes()


def start(
    config: ScheduleConfig,
    now: float,
    step: int,
    mtbf_s: Optional[float] = None,
    process_mtbf_s: Optional[float] = None,
    restored: Optional[Mapping[str, Any]] = None,
    losses: tuple[Optional[float], Optional[float]] = (None, None),
) -> tuple[ScheduleState, Optional[MemoryState]]:
    """The state at the start of a process (fresh or resumed); the memory tier's only when the config
    has one.

    ``mtbf_s`` / ``process_mtbf_s`` are the job's M and M1 (default ``config.job_mtbf_s`` /
    ``config.job_process_mtbf_s``; pass the history estimates in observed mode). ``restored`` is a
    ``state_dict`` from the checkpoint: it keeps the measured costs, so a resumed run does not repeat
    the early measuring saves. Times are not restored: the clock of another process means nothing here.
    ``losses``: the job's M2 and M3 of a three-level schedule (node and whole-job losses; default
    ``config.job_mtbf_s`` and ``config.job_loss_mtbf_s``), used only when ``config.replicates``.
    """
    restored = valid_restored(restored or {})[0]
    last_write = restored.get("last_write_s")
    state = ScheduleState(
        config=config,
        mtbf_s=config.job_mtbf_s if mtbf_s is None else float(mtbf_s),
        anchor_time=float(now),
        anchor_step=int(step),
        costs=_costs(restored.get("costs", ())),
        last_write_s=None if last_write is None else float(last_write),
        saves=int(restored.get("saves", 0)),
    )
    if not config.takes_memory_snapshots:
        return state, None
    memory = MemoryState(
        process_mtbf_s=config.job_process_mtbf_s if process_mtbf_s is None else float(process_mtbf_s),
        anchor_time=float(now),
        anchor_step=int(step),
        costs=_costs(restored.get("memory_costs", ())),
        snapshots=int(restored.get("memory_snapshots", 0)),
    )
    if not config.replicates:
        return state, memory
    node, job = losses
    return state, dataclasses.replace(
        memory,
        node_mtbf_s=config.job_mtbf_s if node is None else float(node),
        job_loss_mtbf_s=config.job_loss_mtbf_s if job is None else float(job),
        replica_costs=_costs(restored.get("replica_costs", ())),
    )


def state_dict(state: ScheduleState, memory: Optional[MemoryState] = None) -> dict:
    """The part of the state worth keeping across a restart (JSON-friendly)."""
    kept = {"costs": list(state.costs), "last_write_s": state.last_write_s, "saves": state.saves}
    if memory is not None:
        kept.update(memory_costs=list(memory.costs), memory_snapshots=memory.snapshots)
        if memory.replica_costs:
            kept.update(replica_costs=list(memory.replica_costs))
    return kept


MAX_COST_S = 86400.0
"""The most seconds a restored cost or write time may say: no save takes a day."""


def valid_restored(restored: Mapping[str, Any]) -> tuple[dict, list[str]]:
    """The restored schedule state (from a checkpoint: untrusted) with every value that is not what a run
    writes left out, and one line per value left out. Costs and the last write time must be finite seconds
    in [0, ``MAX_COST_S``], counts non-negative integers; a value left out takes its fresh default."""
    kept: dict = {}
    problems: list[str] = []
    for key in ("costs", "memory_costs", "replica_costs"):
        values = restored.get(key, ())
        if isinstance(values, (list, tuple)) and all(_seconds(v) for v in values):
            kept[key] = values
        elif values not in ((), []):
            problems.append(f"{key}: not a list of finite seconds in [0, {MAX_COST_S:.0f}]")
    last = restored.get("last_write_s")
    if last is None or _seconds(last):
        kept["last_write_s"] = last
    else:
        problems.append(f"last_write_s={last!r:.40}: not finite seconds in [0, {MAX_COST_S:.0f}]")
    for key in ("saves", "memory_snapshots"):
        count = restored.get(key, 0)
        if type(count) is int and count >= 0:
            kept[key] = count
        else:
            problems.append(f"{key}={count!r:.40}: not a count")
    return kept, problems


def _seconds(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and 0 <= value <= MAX_COST_S


def _costs(values: Any) -> tuple:
    return tuple(float(c) for c in values)[-COST_WINDOW:]


def _with_cost(costs: tuple, blocked_s: float) -> tuple:
    if not (math.isfinite(blocked_s) and blocked_s >= 0):
        raise ValueError(f"blocked_s={blocked_s!r} must be a finite number of seconds >= 0")
    return (costs + (float(blocked_s),))[-COST_WINDOW:]


# The durable tier on its own (the whole schedule without a memory tier)


def cost_estimate(state: ScheduleState) -> float:
    """C: the median of the recent measured blocking costs, or the conservative initial guess."""
    return statistics.median(state.costs) if state.costs else state.config.initial_cost_s


def current_interval(state: ScheduleState) -> Optional[float]:
    """T* for the current C and M, clamped to [min_interval, max_interval], floored by the last write.

    ``None`` when time-based snapshots are off (``mtbf=None``).
    """
    if state.mtbf_s is None:
        return None
    cfg = state.config
    t = optimal_interval(cost_estimate(state), state.mtbf_s, cfg.formula)
    t = min(max(t, cfg.min_interval_s), cfg.max_interval_s)
    return max(t, state.last_write_s or 0.0)


def due_time(state: ScheduleState) -> Optional[float]:
    """When the next time-based save is due; early (after min_interval) while C is unmeasured."""
    interval = current_interval(state)
    if interval is None:
        return None
    if not state.costs:
        interval = state.config.min_interval_s
    return state.anchor_time + interval


def _steps_until(state: ScheduleState, now: float, step: int, target: float) -> int:
    """Steps expected before ``target`` (a time), from the mean step time since the anchor; >= 1."""
    elapsed_steps = step - state.anchor_step
    elapsed = now - state.anchor_time
    if elapsed_steps <= 0 or elapsed <= 0:
        return 1  # no step time known yet: look again at the next step
    per_step = elapsed / elapsed_steps
    # a hair early rather than one step late when float rounding puts the target on a step boundary
    return max(1, math.ceil((target - now) / per_step - 1e-6))


def _next_check(state: ScheduleState, now: float, step: int, target: Optional[float]) -> int:
    cfg = state.config
    horizon = now + cfg.check_interval_s
    target = horizon if target is None else min(target, horizon)
    nxt = step + _steps_until(state, now, step, target)
    if cfg.every_n_train_steps_max is not None:
        nxt = min(nxt, max(step + 1, state.anchor_step + cfg.every_n_train_steps_max))
    return nxt


def _write_end(state: ScheduleState, now: float) -> float:
    """When the in-flight write should be durable: its start plus the last write's duration, or,
    with no (or an overrun) estimate, as long again as it has already run (backing off)."""
    started = state.write_started_at if state.write_started_at is not None else now
    expected = started + (state.last_write_s or 0.0)
    return expected if expected > now else now + (now - started)


def _single_level(state: ScheduleState, now: float, step: int) -> Decision:
    """The durable tier's own schedule: a save when the step cap ``every_n_train_steps_max`` is reached
    (it takes precedence over ``min_interval``) or T* has passed (min_interval while C is unmeasured),
    never while the previous write is in flight."""
    cfg = state.config
    if state.write_started_at is not None:
        return Decision(Tier.NONE, SaveReason.WRITE_IN_FLIGHT, _next_check(state, now, step, _write_end(state, now)))
    cap = cfg.every_n_train_steps_max
    if cap is not None and step - state.anchor_step >= cap:
        return Decision(Tier.DURABLE, SaveReason.STEP_CAP, step + 1)
    due = due_time(state)
    if due is not None and now >= due:
        reason = SaveReason.INTERVAL if state.costs else SaveReason.FIRST_MEASUREMENT
        return Decision(Tier.DURABLE, reason, step + 1)
    reason = SaveReason.OFF if due is None and cap is None else SaveReason.NOT_DUE
    return Decision(Tier.NONE, reason, _next_check(state, now, step, due))


# The two-level schedule (memory tier + durable tier)


def memory_cost_estimate(state: ScheduleState, memory: MemoryState) -> float:
    """C1: the median of the recent measured memory-snapshot costs, or the conservative guess."""
    return statistics.median(memory.costs) if memory.costs else state.config.memory_initial_cost_s


def replica_cost_estimate(state: ScheduleState, memory: MemoryState) -> float:
    """D2: the median of the recent measured replica transfer times, or the conservative guess."""
    return statistics.median(memory.replica_costs) if memory.replica_costs else state.config.replica_initial_cost_s


def replica_step_cost_estimate(state: ScheduleState, memory: MemoryState) -> float:
    """C2: the measured training time a replica transfer costs (``replica_cost.transfer_cost``), or, until both
    calm steps and a finished transfer were seen, the prior ``REPLICA_STEP_OVERHEAD`` of D2."""
    measured = transfer_cost(memory.step_times)
    return REPLICA_STEP_OVERHEAD * replica_cost_estimate(state, memory) if measured is None else measured


def levels(state: ScheduleState, memory: MemoryState) -> Optional[Levels]:
    """The three-level model's inputs now (``None`` without replicas, or unless every MTBF is known)."""
    m1, m2, m3 = memory.process_mtbf_s, memory.node_mtbf_s, memory.job_loss_mtbf_s
    if not state.config.replicates or m1 is None or m2 is None or m3 is None or state.mtbf_s is None:
        return None
    d2 = replica_cost_estimate(state, memory)
    c1, c3 = memory_cost_estimate(state, memory), cost_estimate(state)
    c2 = replica_step_cost_estimate(state, memory)
    return Levels(c1=c1, c2=c2, d2=d2, c3=c3, m1=m1, m2=m2, m3=m3)


def _two_level_inputs(state: ScheduleState, memory: MemoryState) -> Optional[tuple[float, float, float, float]]:
    """(C1, C2, M1, M2) of the two-level model: the current estimates, or with replicas the three-level
    model's own (node and job losses merged: what a schedule that does not replicate sends to disk)."""
    three = levels(state, memory)
    if three is not None:
        return three.without_replicas()
    if memory.process_mtbf_s is None or state.mtbf_s is None or state.config.replicates:
        return None
    return memory_cost_estimate(state, memory), cost_estimate(state), memory.process_mtbf_s, state.mtbf_s


def current_plan(state: ScheduleState, memory: MemoryState) -> Optional[TwoLevelPlan]:
    """The unclamped optimum for the current estimates: without replicas the two-level one for C1, C2, M1,
    M2 (``None`` unless both MTBFs are known); with replicas the three-level one (a ``ThreeLevelPlan``)."""
    three = levels(state, memory)
    if three is not None:
        return three_level_plan(three)
    inputs = _two_level_inputs(state, memory)
    return None if inputs is None else two_level_plan(*inputs)


def replicate_now(state: ScheduleState, memory: MemoryState) -> bool:
    """Whether the memory snapshot taken now is sent to the peers: with replicas, as the plan says (always
    while D2 is unmeasured, so that it is measured, and when no plan paces the tier); else never."""
    if not state.config.replicates:
        return False
    plan = current_plan(state, memory)
    return not memory.replica_costs or not isinstance(plan, ThreeLevelPlan) or plan.replicate


def memory_interval(state: ScheduleState, memory: MemoryState) -> Optional[float]:
    """T1 clamped to [min_interval, max_interval]: the plan's, or Young's ``sqrt(2 C1 M1)`` when the
    durable tier has no MTBF; ``None`` when only a memory step cap paces the tier."""
    if memory.process_mtbf_s is None:
        return None
    plan = current_plan(state, memory)
    cfg = state.config
    t1 = plan.t1 if plan is not None else young_interval(memory_cost_estimate(state, memory), memory.process_mtbf_s)
    return min(max(t1, cfg.min_interval_s), cfg.max_interval_s)


def durable_every(state: ScheduleState, memory: MemoryState) -> Optional[int]:
    """k as applied: the plan's, or, when T1 was clamped, the best k for that T1 (the integer
    neighbours of ``sqrt(2 C2 M2) / T1``, which minimises the durable terms of the waste); then
    lowered so that ``k * T1`` stays within max_interval.

    ``None`` without a plan: the durable tier then keeps its own single-level schedule."""
    plan, t1 = current_plan(state, memory), memory_interval(state, memory)
    if plan is None or t1 is None or memory.process_mtbf_s is None or state.mtbf_s is None:
        return None
    k = plan.k
    if not math.isclose(t1, plan.t1):
        k = _k_for(t1, state, memory, plan)
    return max(1, min(k, math.floor(state.config.max_interval_s / t1)))


def _k_for(t1: float, state: ScheduleState, memory: MemoryState, plan: TwoLevelPlan) -> int:
    """The best k for a clamped ``t1``: the three-level one when the plan replicates, else the integer
    neighbours of ``sqrt(2 C2 M2) / T1`` for the two-level waste."""
    three = levels(state, memory)
    if three is not None and isinstance(plan, ThreeLevelPlan) and plan.replicate:
        return three_level_k(t1, three)
    inputs = _two_level_inputs(state, memory)
    assert inputs is not None  # a plan exists
    c1, c2, m1, m2 = inputs
    k_real = math.sqrt(2.0 * c2 * m2) / t1
    candidates = {max(1, math.floor(k_real)), max(1, math.ceil(k_real))}
    return min(sorted(candidates), key=lambda n: two_level_waste(t1, n, c1, c2, m1, m2))


def _durable_reason(state: ScheduleState, memory: MemoryState, now: float, step: int) -> Optional[SaveReason]:
    """Why a durable save is due regardless of the memory tier (cap, first measurement, max interval)."""
    cfg = state.config
    if state.write_started_at is not None:
        return None
    cap = cfg.every_n_train_steps_max
    if cap is not None and step - state.anchor_step >= cap:
        return SaveReason.STEP_CAP
    if durable_every(state, memory) is None:  # no plan: the durable tier is single-level
        decision = _single_level(state, now, step)
        return decision.reason if decision.tier is Tier.DURABLE else None
    if not state.costs and now >= state.anchor_time + cfg.min_interval_s:
        return SaveReason.FIRST_MEASUREMENT
    if now >= state.anchor_time + cfg.max_interval_s:
        return SaveReason.MAX_INTERVAL
    return None


def memory_due_time(state: ScheduleState, memory: MemoryState) -> Optional[float]:
    """When the next memory snapshot is due (after min_interval while C1 is unmeasured)."""
    t1 = memory_interval(state, memory)
    if t1 is None:
        return None
    return memory.anchor_time + (t1 if memory.costs else state.config.min_interval_s)


def _memory_reason(state: ScheduleState, memory: MemoryState, now: float, step: int) -> Optional[SaveReason]:
    cap = state.config.memory_every_n_train_steps_max
    if cap is not None and step - memory.anchor_step >= cap:
        return SaveReason.MEMORY_STEP_CAP
    due = memory_due_time(state, memory)
    if due is not None and now >= due:
        return SaveReason.MEMORY_INTERVAL if memory.costs else SaveReason.MEMORY_FIRST_MEASUREMENT
    return None


def _next_tier_check(state: ScheduleState, memory: MemoryState, now: float, step: int) -> int:
    cfg = state.config
    targets = [memory_due_time(state, memory)]
    if durable_every(state, memory) is None:
        targets.append(due_time(state))
    elif not state.costs:
        targets.append(state.anchor_time + cfg.min_interval_s)
    else:
        targets.append(state.anchor_time + cfg.max_interval_s)
    if state.write_started_at is not None:
        targets.append(_write_end(state, now))
    known = [t for t in targets if t is not None]
    nxt = _next_check(state, now, step, min(known) if known else None)
    cap = cfg.memory_every_n_train_steps_max
    if cap is not None:
        nxt = min(nxt, max(step + 1, memory.anchor_step + cap))
    return nxt


def decide(state: ScheduleState, memory: Optional[MemoryState], now: float, step: int) -> Decision:
    """Rank 0's decision at a check: snapshot now, and to which tier? (``step`` = global steps
    completed; ``now`` = monotonic seconds.) Without a memory tier (``memory`` is ``None`` or the
    config has none) the durable tier's own schedule decides (see ``_single_level``).

    With one: a durable save when the durable tier's own triggers fire (its step cap, its first
    measurement, max_interval since the last durable save; or, with no two-level plan because the
    node MTBF is off, its single-level schedule), or when the memory snapshot due now is the k-th
    since the last durable save (and no async write is in flight); else a memory snapshot when T1
    (or the memory step cap) has passed since the newest snapshot of either tier. The first memory
    snapshot is never promoted to durable: it measures C1, which the plan's k depends on. With replicas,
    a snapshot's ``replicate`` is ``replicate_now``'s answer.
    """
    if memory is None or not state.config.takes_memory_snapshots:
        return _single_level(state, now, step)
    decision = _two_tier(state, memory, now, step)
    if decision.tier is Tier.NONE or not replicate_now(state, memory):
        return decision
    return dataclasses.replace(decision, replicate=True)


def _two_tier(state: ScheduleState, memory: MemoryState, now: float, step: int) -> Decision:
    durable = _durable_reason(state, memory, now, step)
    if durable is not None:
        return Decision(Tier.DURABLE, durable, step + 1)
    reason = _memory_reason(state, memory, now, step)
    if reason is not None:
        k = durable_every(state, memory)
        # never promote the measuring snapshot: a guessed C1 giving k = 1 would never be measured
        measuring = reason is SaveReason.MEMORY_FIRST_MEASUREMENT
        if k is not None and not measuring and state.write_started_at is None and memory.since_durable + 1 >= k:
            return Decision(Tier.DURABLE, SaveReason.EVERY_KTH, step + 1)
        return Decision(Tier.MEMORY, reason, step + 1)
    idle = SaveReason.WRITE_IN_FLIGHT if state.write_started_at is not None else SaveReason.NOT_DUE
    return Decision(Tier.NONE, idle, _next_tier_check(state, memory, now, step))


# After a snapshot


def record_save(
    state: ScheduleState, now: float, step: int, blocked_s: float, write_s: Optional[float] = None
) -> ScheduleState:
    """The state after a save whose blocking part ended at ``now`` and took ``blocked_s``.

    Pass ``write_s`` when the write is already durable (synchronous save); leave it ``None`` when
    an async write has just started, and call ``record_write_done`` when it is durable.
    """
    costs = _with_cost(state.costs, blocked_s)
    if write_s is not None and not (math.isfinite(write_s) and write_s >= 0):
        raise ValueError(f"write_s={write_s!r} must be a finite number of seconds >= 0, or None if in flight")
    return dataclasses.replace(
        state,
        anchor_time=float(now),
        anchor_step=int(step),
        costs=costs,
        last_write_s=state.last_write_s if write_s is None else float(write_s),
        write_started_at=float(now) if write_s is None else None,
        saves=state.saves + 1,
    )


def record_write_done(state: ScheduleState, now: float, write_s: Optional[float] = None) -> ScheduleState:
    """The state once the in-flight write is durable; ``write_s`` defaults to its time since start."""
    if state.write_started_at is None:
        return state
    duration = max(0.0, now - state.write_started_at) if write_s is None else float(write_s)
    return dataclasses.replace(state, last_write_s=duration, write_started_at=None)


def record_memory_snapshot(memory: MemoryState, now: float, step: int, blocked_s: float) -> MemoryState:
    """The memory tier's state after a memory snapshot whose blocking part ended at ``now``.

    At the step of the newest durable save (the mechanism refreshing the memory copy of that save)
    only the cost is recorded: that snapshot was already counted as the durable one."""
    costs = _with_cost(memory.costs, blocked_s)
    if memory.durable_step is not None and int(step) == memory.durable_step:
        return dataclasses.replace(memory, costs=costs)
    return dataclasses.replace(
        memory,
        anchor_time=float(now),
        anchor_step=int(step),
        costs=costs,
        since_durable=memory.since_durable + 1,
        snapshots=memory.snapshots + 1,
    )


def record_durable_snapshot(memory: MemoryState, now: float, step: int) -> MemoryState:
    """The memory tier's state after a durable save (which is also that step's memory snapshot)."""
    return dataclasses.replace(
        memory, anchor_time=float(now), anchor_step=int(step), since_durable=0, durable_step=int(step)
    )


# Reported (metrics)


def expected_waste_now(state: ScheduleState) -> Optional[float]:
    """Expected waste fraction at the current T*, C and M (``None`` when time-based saves are off)."""
    interval = current_interval(state)
    if interval is None or interval <= 0 or state.mtbf_s is None:
        return None
    return expected_waste(interval, cost_estimate(state), state.mtbf_s)


def two_level_waste_now(state: ScheduleState, memory: MemoryState) -> Optional[float]:
    """First-order expected waste at the clamped T1 and applied k (``None`` without a plan); the
    three-level waste when the plan replicates."""
    t1, k = memory_interval(state, memory), durable_every(state, memory)
    inputs = _two_level_inputs(state, memory)
    if t1 is None or k is None or inputs is None:
        return None
    three = levels(state, memory)
    if three is not None and replicate_now(state, memory):
        return three_level_waste(t1, k, three)
    return two_level_waste(t1, k, *inputs)


def record_replica_transfer(memory: MemoryState, seconds: float) -> MemoryState:
    """The memory tier's state after a replica transfer that took ``seconds`` (a D2 sample)."""
    return dataclasses.replace(memory, replica_costs=_with_cost(memory.replica_costs, seconds))


def record_step_time(memory: MemoryState, seconds: float, transfer: Optional[int]) -> MemoryState:
    """The memory tier's state after a training step that took ``seconds`` (our snapshots' blocking left out)
    and overlapped replica ``transfer`` (``None``: a calm step): a C2 sample (``replica_cost``)."""
    return dataclasses.replace(memory, step_times=record_step(memory.step_times, seconds, transfer))
