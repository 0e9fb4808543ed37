"""When to snapshot: Young's and Daly's optimal intervals and the schedule state machine.

This module owns the *policy* of scheduled snapshots: the interval formulas, the expected-waste
model, the validated ``ScheduleConfig`` and a frozen ``ScheduleState`` driven by pure functions.
The clock is always passed in (``now``, seconds of a monotonic clock) and measurements arrive as
arguments. It must not import Lightning, read a clock, touch files or talk to other ranks: the
callback gathers inputs, asks ``should_save`` on rank 0, broadcasts the ``SaveDecision`` and reports
back with ``record_save`` / ``record_write_done``.

Conventions (as in Daly 2006): an *interval* is training time between the end of one save's
blocking part and the start of the next save; ``c`` is the time training is blocked by one save
(for async saves the snapshot copy only); ``m`` is the job's mean time between failures
(per-node MTBF divided by the number of nodes).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping, Optional, Union, cast

from lightning_resume.durations import Duration, parse_duration
from lightning_resume.errors import ConfigurationError

DEFAULT_MIN_INTERVAL: Duration = "1min"
DEFAULT_MAX_INTERVAL: Duration = "6h"
DEFAULT_INITIAL_COST: Duration = "60s"
DEFAULT_CHECK_INTERVAL: Duration = "10s"
DEFAULT_MTBF: Duration = "observed"
DEFAULT_MTBF_PRIOR: Duration = "30d"
"""The schedule's defaults, written once: ``ScheduleConfig`` and ``ExactResume``'s arguments use these.

The MTBF prior is per node. Meta's Llama 3 405B run (Llama 3 paper, 2024) saw 419 unexpected
interruptions in 54 days on 2,048 nodes of 8 H100s: about 6,300 h (260 days) per node. The prior is
about 9x shorter, for clusters less tended than that one, preemptible capacity and software failures;
if the truth is k times longer the waste is (sqrt(k) + 1/sqrt(k)) / 2 of the optimum (1.7x at k = 9),
and the observed history replaces the prior as failures (or failure-free time) accumulate."""

COST_WINDOW = 5
"""How many recent blocking costs the C estimate is the median of (robust to one slow first save)."""


class Formula(str, Enum):
    """Which optimal-interval formula the schedule uses."""

    YOUNG = "young"  # T* = sqrt(2CM), Young 1974: first order, fine while C << M
    DALY = "daly"  # Daly 2006 higher-order estimate: better when C is a sizeable fraction of M


class MtbfMode(str, Enum):
    """Where the job's M comes from."""

    CONFIGURED = "configured"  # M = mtbf / num_nodes, fixed
    OBSERVED = "observed"  # M from the run's failure history, with the configured value as prior


class SaveReason(str, Enum):
    """Why ``should_save`` answered as it did (logged, and handy in tests)."""

    FIRST_MEASUREMENT = "first_measurement"  # no C measured yet: save early to measure it
    INTERVAL = "interval"  # T* has elapsed since the last save
    STEP_CAP = "step_cap"  # every_n_train_steps_max steps have passed since the last save
    NOT_DUE = "not_due"
    WRITE_IN_FLIGHT = "write_in_flight"  # due (or not), but the previous async write is not durable yet
    OFF = "off"  # mtbf=None and no step cap


# --------------------------------------------------------------------------------------------
# Formulas
# --------------------------------------------------------------------------------------------


def _check_cost_mtbf(c: float, m: float) -> None:
    if not (math.isfinite(c) and c >= 0):
        raise ValueError(f"checkpoint cost c={c!r} must be a finite number of seconds >= 0")
    if not (math.isfinite(m) and m > 0):
        raise ValueError(f"mean time between failures m={m!r} must be a finite number of seconds > 0")


def young_interval(c: float, m: float) -> float:
    """Young's optimal interval ``sqrt(2 c m)`` in seconds (CACM 17(9), 1974)."""
    _check_cost_mtbf(c, m)
    return math.sqrt(2.0 * c * m)


def daly_interval(c: float, m: float) -> float:
    """Daly's higher-order optimal interval in seconds (FGCS 22(3), 2006, eq. 37).

    ``sqrt(2cm) * [1 + sqrt(c/2m)/3 + (c/2m)/9] - c`` for ``c < 2m``, else ``m``. As in the paper,
    the estimate jumps from ``8m/9`` to ``m`` at ``c = 2m``: it is monotone in ``c`` everywhere and
    in ``m`` on each side of that point.
    """
    _check_cost_mtbf(c, m)
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def optimal_interval(c: float, m: float, formula: Formula = Formula.YOUNG) -> float:
    """The unclamped optimal interval for ``formula``."""
    return daly_interval(c, m) if Formula(formula) is Formula.DALY else young_interval(c, m)


def expected_waste(t: float, c: float, m: float, restart_s: float = 0.0) -> float:
    """Expected fraction of wall time not spent on useful training, for Poisson failures.

    Exact for exponential inter-failure times with mean ``m`` (Daly 2006, eq. 13): a segment of
    ``t`` seconds of work plus a ``c``-second save takes ``m e^{r/m} (e^{(t+c)/m} - 1)`` seconds of
    wall time on average, failures included (work since the last save is redone after a
    ``restart_s`` restart). Returns ``1 - t / that``. To first order this is ``c/t + t/(2m)``
    (see ``first_order_waste``), minimised by Young's interval.
    """
    _check_cost_mtbf(c, m)
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"interval t={t!r} must be a finite number of seconds > 0")
    exponent = (t + c + restart_s) / m
    if exponent > 700.0:  # e^700 is near float max: a failure-free segment is hopeless
        return 1.0
    wall = m * math.exp(restart_s / m) * math.expm1((t + c) / m)
    return max(0.0, 1.0 - t / wall)


def first_order_waste(t: float, c: float, m: float) -> float:
    """Young's first-order waste model ``c/t + t/(2m)`` (can exceed 1 when c/m is large)."""
    _check_cost_mtbf(c, m)
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"interval t={t!r} must be a finite number of seconds > 0")
    return c / t + t / (2.0 * m)


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def _positive(value: Optional[float]) -> bool:
    return value is not None and math.isfinite(value) and value > 0


@dataclass(frozen=True)
class ScheduleConfig:
    """Validated schedule options; every duration is in seconds.

    ``mtbf_s`` is the per-node MTBF (``None`` turns time-based snapshots off; a step cap still
    applies). In ``MtbfMode.OBSERVED`` it is the prior, worth ``prior_weight`` pseudo-failures.
    ``initial_cost_s`` is the conservative C used before the first measurement (reported only:
    the first save happens as soon as ``min_interval_s`` has passed, to measure C).
    ``check_interval_s`` bounds the time between two decisions, so a preemption flag raised on any
    rank is seen within it and rank 0 broadcasts at most once per check.
    """

    mtbf_s: Optional[float] = None
    num_nodes: int = 1
    formula: Formula = Formula.YOUNG
    min_interval_s: float = parse_duration(DEFAULT_MIN_INTERVAL)
    max_interval_s: float = parse_duration(DEFAULT_MAX_INTERVAL)
    every_n_train_steps_max: Optional[int] = None
    initial_cost_s: float = parse_duration(DEFAULT_INITIAL_COST)
    mtbf_mode: MtbfMode = MtbfMode.CONFIGURED
    prior_weight: float = 1.0
    check_interval_s: float = parse_duration(DEFAULT_CHECK_INTERVAL)

    def __post_init__(self) -> None:
        problems = []
        for name, enum in (("formula", Formula), ("mtbf_mode", MtbfMode)):
            try:
                object.__setattr__(self, name, enum(getattr(self, name)))
            except ValueError:
                choices = ", ".join(repr(e.value) for e in enum)
                problems.append(f"{name}={getattr(self, name)!r} is not one of {choices}")
        problems += self._problems()
        if problems:
            raise ConfigurationError("ScheduleConfig", problems)

    def _problems(self) -> list:
        p = []
        if self.mtbf_s is not None and not _positive(self.mtbf_s):
            p.append(
                f"mtbf={self.mtbf_s!r}s must be > 0; use a duration like '24h', or None to turn scheduled snapshots off"
            )
        if self.mtbf_mode is MtbfMode.OBSERVED and self.mtbf_s is None:
            p.append("mtbf='observed' needs a prior; give mtbf_prior, e.g. '24h'")
        if isinstance(self.num_nodes, bool) or not isinstance(self.num_nodes, int) or self.num_nodes < 1:
            p.append(f"num_nodes={self.num_nodes!r} must be an integer >= 1")
        if not (math.isfinite(self.min_interval_s) and self.min_interval_s >= 0):
            p.append(f"min_interval={self.min_interval_s!r}s must be >= 0")
        if not _positive(self.max_interval_s) or self.max_interval_s < self.min_interval_s:
            p.append(f"max_interval={self.max_interval_s!r}s must be > 0 and >= min_interval={self.min_interval_s!r}s")
        cap = self.every_n_train_steps_max
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            p.append(f"every_n_train_steps_max={cap!r} must be an integer >= 1, or None for no step cap")
        if not _positive(self.initial_cost_s):
            p.append(
                f"initial_cost={self.initial_cost_s!r}s must be > 0 (a conservative guess of the save's blocking time)"
            )
        if not _positive(self.prior_weight):
            p.append(f"prior_weight={self.prior_weight!r} must be > 0 (pseudo-failures the prior MTBF counts for)")
        if not _positive(self.check_interval_s):
            p.append(f"check_interval={self.check_interval_s!r}s must be > 0")
        return p

    @property
    def job_mtbf_s(self) -> Optional[float]:
        """The configured (or prior) M for the whole job: per-node MTBF / num_nodes."""
        return None if self.mtbf_s is None else self.mtbf_s / self.num_nodes

    @classmethod
    def from_user(
        cls,
        mtbf: Union[Duration, None] = None,
        num_nodes: int = 1,
        formula: Union[str, Formula] = Formula.YOUNG,
        min_interval: Duration = DEFAULT_MIN_INTERVAL,
        max_interval: Duration = DEFAULT_MAX_INTERVAL,
        every_n_train_steps_max: Optional[int] = None,
        initial_cost: Duration = DEFAULT_INITIAL_COST,
        mtbf_prior: Optional[Duration] = None,
        check_interval: Duration = DEFAULT_CHECK_INTERVAL,
    ) -> ScheduleConfig:
        """Build from user-facing values (durations as ``"24h"``, seconds or ``timedelta``).

        ``mtbf="observed"`` estimates M from the failure history with ``mtbf_prior`` as prior.
        Every problem is collected into one ``ConfigurationError``.
        """
        problems: list = []

        def seconds(value: Duration, name: str) -> float:
            try:
                return parse_duration(value, name)
            except ValueError as err:
                problems.append(str(err))
                stand_in: float = getattr(cls, name + "_s")  # a valid stand-in, so other problems are found too
                return stand_in

        def optional_seconds(value: Optional[Duration], name: str) -> Optional[float]:
            if value is None:
                return None
            try:
                return parse_duration(value, name)
            except ValueError as err:
                problems.append(str(err))
                return None

        observed = isinstance(mtbf, str) and mtbf.strip().lower() == MtbfMode.OBSERVED.value
        mtbf_s = optional_seconds(mtbf_prior if observed else mtbf, "mtbf_prior" if observed else "mtbf")
        min_interval_s = seconds(min_interval, "min_interval")
        max_interval_s = seconds(max_interval, "max_interval")
        initial_cost_s = seconds(initial_cost, "initial_cost")
        check_interval_s = seconds(check_interval, "check_interval")
        if observed and mtbf_s is None and problems:
            mtbf_s = 1.0  # the bad prior is already reported
        mode = MtbfMode.OBSERVED if observed else MtbfMode.CONFIGURED
        try:
            config = cls(
                mtbf_s=mtbf_s,
                num_nodes=num_nodes,
                # __post_init__ coerces a string to Formula and reports an unknown one as a problem
                formula=cast(Formula, formula),
                min_interval_s=min_interval_s,
                max_interval_s=max_interval_s,
                every_n_train_steps_max=every_n_train_steps_max,
                initial_cost_s=initial_cost_s,
                mtbf_mode=mode,
                check_interval_s=check_interval_s,
            )
        except ConfigurationError as err:
            raise ConfigurationError("ScheduleConfig", problems + err.problems) from None
        if problems:
            raise ConfigurationError("ScheduleConfig", problems)
        return config

    def with_nodes(self, num_nodes: int) -> ScheduleConfig:
        """The same options for ``num_nodes`` nodes (known only once the trainer is set up)."""
        return dataclasses.replace(self, num_nodes=num_nodes)


# --------------------------------------------------------------------------------------------
# State machine
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SaveDecision:
    """Rank 0's answer at a check: save now or not, why, and the step of the next check.

    Between checks the callback needs no collective; ``next_check_step`` (> the current step)
    is broadcast together with ``save`` so every rank checks at the same step.
    """

    save: bool
    reason: SaveReason
    next_check_step: int


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


def start_schedule(
    config: ScheduleConfig,
    now: float,
    step: int,
    mtbf_s: Optional[float] = None,
    restored: Optional[Mapping[str, Any]] = None,
) -> ScheduleState:
    """The state at the start of a process (fresh or resumed).

    ``mtbf_s`` is the job's M (default ``config.job_mtbf_s``; pass the history estimate in observed
    mode). ``restored`` is a ``schedule_state_dict`` from the checkpoint: it keeps the measured
    costs, so a resumed run does not repeat the early measuring save. Times are not restored:
    the clock of another process means nothing here.
    """
    restored = restored or {}
    costs = tuple(float(c) for c in restored.get("costs", ()))[-COST_WINDOW:]
    last_write = restored.get("last_write_s")
    return ScheduleState(
        config=config,
        mtbf_s=config.job_mtbf_s if mtbf_s is None else float(mtbf_s),
        anchor_time=float(now),
        anchor_step=int(step),
        costs=costs,
        last_write_s=None if last_write is None else float(last_write),
        saves=int(restored.get("saves", 0)),
    )


def schedule_state_dict(state: ScheduleState) -> dict:
    """The part of the state worth keeping across a restart (JSON-friendly)."""
    return {"costs": list(state.costs), "last_write_s": state.last_write_s, "saves": state.saves}


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
    return max(1, math.ceil((target - now) / per_step))


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


def should_save(state: ScheduleState, now: float, step: int) -> SaveDecision:
    """Rank 0's decision at a check (``step`` = global steps completed; ``now`` = monotonic seconds).

    A save is never started while the previous write is in flight. The step cap
    ``every_n_train_steps_max`` takes precedence over ``min_interval``.
    """
    cfg = state.config
    if state.write_started_at is not None:
        return SaveDecision(False, SaveReason.WRITE_IN_FLIGHT, _next_check(state, now, step, _write_end(state, now)))
    cap = cfg.every_n_train_steps_max
    if cap is not None and step - state.anchor_step >= cap:
        return SaveDecision(True, SaveReason.STEP_CAP, step + 1)
    due = due_time(state)
    if due is not None and now >= due:
        reason = SaveReason.INTERVAL if state.costs else SaveReason.FIRST_MEASUREMENT
        return SaveDecision(True, reason, step + 1)
    reason = SaveReason.OFF if due is None and cap is None else SaveReason.NOT_DUE
    return SaveDecision(False, reason, _next_check(state, now, step, due))


def record_save(
    state: ScheduleState, now: float, step: int, blocked_s: float, write_s: Optional[float] = None
) -> ScheduleState:
    """The state after a save whose blocking part ended at ``now`` and took ``blocked_s``.

    Pass ``write_s`` when the write is already durable (synchronous save); leave it ``None`` when
    an async write has just started, and call ``record_write_done`` when it is durable.
    """
    if not (math.isfinite(blocked_s) and blocked_s >= 0):
        raise ValueError(f"blocked_s={blocked_s!r} must be a finite number of seconds >= 0")
    if write_s is not None and not (math.isfinite(write_s) and write_s >= 0):
        raise ValueError(f"write_s={write_s!r} must be a finite number of seconds >= 0, or None if in flight")
    return dataclasses.replace(
        state,
        anchor_time=float(now),
        anchor_step=int(step),
        costs=(state.costs + (float(blocked_s),))[-COST_WINDOW:],
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


def expected_waste_now(state: ScheduleState) -> Optional[float]:
    """Expected waste fraction at the current T*, C and M (``None`` when time-based saves are off)."""
    interval = current_interval(state)
    if interval is None or interval <= 0 or state.mtbf_s is None:
        return None
    return expected_waste(interval, cost_estimate(state), state.mtbf_s)
