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
DEFAULT_MEMORY_INITIAL_COST: Duration = "5s"
DEFAULT_MTBF: Duration = "observed"
DEFAULT_MTBF_PRIOR: Duration = "30d"
DEFAULT_PROCESS_MTBF_PRIOR: Duration = "1h"
"""The schedule's defaults, written once: ``ScheduleConfig`` and ``ExactResume``'s arguments use these.

The MTBF prior is per node. Meta's Llama 3 405B run (Llama 3 paper, 2024) saw 419 unexpected
interruptions in 54 days on 2,048 nodes of 8 H100s: about 6,300 h (260 days) per node. The prior is
about 9x shorter, for clusters less tended than that one, preemptible capacity and software failures;
if the truth is k times longer the waste is (sqrt(k) + 1/sqrt(k)) / 2 of the optimum (1.7x at k = 9),
and the observed history replaces the prior as failures (or failure-free time) accumulate. The process
MTBF prior (M1, the memory tier's failures: exceptions, OOM kills, timeouts, deploys, which keep the
machine) is the common kind of failure, so it is much shorter; the history refines it the same way."""

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
    MEMORY_FIRST_MEASUREMENT = "memory_first_measurement"  # no C1 measured yet: snapshot early to measure it
    MEMORY_INTERVAL = "memory_interval"  # T1 has elapsed since the last snapshot of either tier
    MEMORY_STEP_CAP = "memory_step_cap"  # memory_every_n_train_steps_max steps since the last snapshot
    EVERY_KTH = "every_kth"  # the memory snapshot due now is the k-th since the last durable save: durable
    MAX_INTERVAL = "max_interval"  # max_interval has passed since the last durable save


class Tier(str, Enum):
    """Where a snapshot goes: nowhere, the memory tier (survives a crashed process, not a lost node) or
    the durable tier (disk or object store; survives anything)."""

    NONE = "none"
    MEMORY = "memory"
    DURABLE = "durable"


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
# Two-level formulas
# --------------------------------------------------------------------------------------------

MAX_K = 1_000_000
"""Upper bound on k (durable saves every k-th memory snapshot): reached only when C1 is ~0."""


@dataclass(frozen=True)
class TwoLevelPlan:
    """The optimum of the two-level model: a memory snapshot every ``t1`` seconds, every ``k``-th of
    them durable (so a durable save every ``t2 = k * t1``), with ``waste`` the expected fraction of
    time lost (first order, see ``two_level_waste``)."""

    t1: float
    k: int
    waste: float

    @property
    def t2(self) -> float:
        """Seconds between durable saves: ``k * t1``."""
        return self.k * self.t1


def _check_two_level(c1: float, c2: float, m1: float, m2: float) -> None:
    for name, c in (("c1", c1), ("c2", c2)):
        if not (math.isfinite(c) and c >= 0):
            raise ValueError(f"checkpoint cost {name}={c!r} must be a finite number of seconds >= 0")
    for name, m in (("m1", m1), ("m2", m2)):
        if not (math.isfinite(m) and m > 0):
            raise ValueError(f"mean time between failures {name}={m!r} must be a finite number of seconds > 0")


def two_level_waste(t1: float, k: int, c1: float, c2: float, m1: float, m2: float) -> float:
    """First-order expected waste ``C1/T1 + C2/(k T1) + T1/(2 M1) + k T1/(2 M2)`` of a two-level plan.

    The model (Moody et al., "Design, modeling, and evaluation of a scalable multi-level
    checkpointing system", SC'10; Di et al., "Optimization of multi-level checkpoint model for large
    scale HPC applications", IPDPS'14; first order, as Young's): a memory snapshot every ``T1``
    seconds of training costs ``C1`` of blocking; every ``k``-th is also written to the durable tier
    at an extra ``C2``. Process failures (rate ``1/M1``: an exception, an OOM kill, a collective
    timeout; the node and its shared memory survive) roll back to the newest memory snapshot, on
    average ``T1/2`` of work; node failures (rate ``1/M2``: the memory is gone) roll back to the
    newest durable save, on average ``k T1 / 2``. Per unit of time that is the sum above; it
    ignores failures during saves and restarts (fine while C1, C2 << T1 and T1 << M1).

    A durable save *is* that step's memory snapshot too (the mechanism keeps the memory copy of the
    state it just staged for the durable write), so a process failure right after it loses nothing
    more. Its cost is counted as ``C1 + C2``, exact when the memory copy is a separate memcpy and an
    upper bound by C1 when the durable save's staging is reused; ``k = 1`` is then a single-level
    schedule with cost ``C1 + C2`` and rate ``1/M1 + 1/M2``.
    """
    _check_two_level(c1, c2, m1, m2)
    if not (math.isfinite(t1) and t1 > 0):
        raise ValueError(f"interval t1={t1!r} must be a finite number of seconds > 0")
    if isinstance(k, bool) or int(k) != k or k < 1:
        raise ValueError(f"k={k!r} must be an integer >= 1 (durable every k-th memory snapshot)")
    return c1 / t1 + c2 / (k * t1) + t1 / (2.0 * m1) + k * t1 / (2.0 * m2)


def two_level_t1(k: int, c1: float, c2: float, m1: float, m2: float) -> float:
    """The optimal ``T1`` for a fixed ``k``: ``sqrt(2 (C1 + C2/k) / (1/M1 + k/M2))``.

    (Setting ``dW/dT1 = 0`` in ``two_level_waste``.) Zero when both costs are zero.
    """
    _check_two_level(c1, c2, m1, m2)
    return math.sqrt(2.0 * (c1 + c2 / k) / (1.0 / m1 + k / m2))


def two_level_plan(c1: float, c2: float, m1: float, m2: float) -> TwoLevelPlan:
    """The optimal two-level plan for memory-snapshot cost ``c1``, durable cost ``c2`` (seconds of
    blocking), process MTBF ``m1`` and node MTBF ``m2`` (seconds, for the whole job).

    At its best ``T1`` the waste for a given ``k`` is ``sqrt(2 (C1 + C2/k) (1/M1 + k/M2))``; the
    product expands to ``C1/M1 + C2/M2 + C1 k/M2 + C2/(k M1)``, minimised over real ``k`` at
    ``k* = sqrt(C2 M2 / (C1 M1))``. The waste is convex in ``k``, so the best integer is one of
    ``floor(k*)``, ``ceil(k*)`` (at least 1, at most ``MAX_K``). Unclamped: the scheduler applies
    ``min_interval`` / ``max_interval``. When both costs are 0 the plan is ``t1 = 0``, ``waste = 0``.
    """
    _check_two_level(c1, c2, m1, m2)
    if c1 > 0:
        k_real = math.sqrt(c2 * m2 / (c1 * m1))
    else:  # a free memory tier: durable as rarely as allowed, unless durable saves are free too
        k_real = float(MAX_K) if c2 > 0 else 1.0
    candidates = {min(MAX_K, max(1, math.floor(k_real))), min(MAX_K, max(1, math.ceil(k_real)))}
    best: Optional[TwoLevelPlan] = None
    for k in sorted(candidates):
        t1 = two_level_t1(k, c1, c2, m1, m2)
        waste = two_level_waste(t1, k, c1, c2, m1, m2) if t1 > 0 else 0.0
        if best is None or waste < best.waste:
            best = TwoLevelPlan(t1=t1, k=k, waste=waste)
    assert best is not None
    return best


def single_level_waste(c: float, m1: float, m2: float) -> float:
    """First-order waste of the single-level optimum for the same failures: every failure (rate
    ``1/M1 + 1/M2``) rolls back to a durable save of cost ``c`` taken every Young interval:
    ``sqrt(2 c (1/M1 + 1/M2))``."""
    _check_two_level(c, c, m1, m2)
    return math.sqrt(2.0 * c * (1.0 / m1 + 1.0 / m2))


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

    Two-level schedule (memory tier): ``process_mtbf_s`` is the per-node mean time between *process*
    failures that leave the node and its shared memory alive (M1; ``mtbf_s`` stays the node MTBF,
    M2). ``None`` with no ``memory_every_n_train_steps_max`` is the single-level schedule, exactly as
    before. ``memory_initial_cost_s`` is the conservative C1 assumed before the first measurement.
    In ``process_mtbf_mode`` OBSERVED, ``process_mtbf_s`` is the prior of M1.
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
    process_mtbf_s: Optional[float] = None
    memory_every_n_train_steps_max: Optional[int] = None
    process_mtbf_mode: MtbfMode = MtbfMode.CONFIGURED
    memory_initial_cost_s: float = parse_duration(DEFAULT_MEMORY_INITIAL_COST)

    def __post_init__(self) -> None:
        problems = []
        for name, enum in (("formula", Formula), ("mtbf_mode", MtbfMode), ("process_mtbf_mode", MtbfMode)):
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
        return p + self._memory_problems()

    def _memory_problems(self) -> list:
        p = []
        if self.process_mtbf_s is not None and not _positive(self.process_mtbf_s):
            p.append(
                f"process_mtbf={self.process_mtbf_s!r}s must be > 0; use a duration like '1h', "
                "or None for no memory tier"
            )
        if self.process_mtbf_mode is MtbfMode.OBSERVED and self.process_mtbf_s is None:
            p.append("process_mtbf='observed' needs a prior; give process_mtbf_prior, e.g. '6h'")
        cap = self.memory_every_n_train_steps_max
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            p.append(f"memory_every_n_train_steps_max={cap!r} must be an integer >= 1, or None for no memory step cap")
        if not _positive(self.memory_initial_cost_s):
            p.append(
                f"memory_initial_cost={self.memory_initial_cost_s!r}s must be > 0 "
                "(a conservative guess of a memory snapshot's blocking time)"
            )
        return p

    @property
    def job_mtbf_s(self) -> Optional[float]:
        """The configured (or prior) M for the whole job: per-node MTBF / num_nodes."""
        return None if self.mtbf_s is None else self.mtbf_s / self.num_nodes

    @property
    def job_process_mtbf_s(self) -> Optional[float]:
        """The configured (or prior) M1 for the whole job: per-node process MTBF / num_nodes."""
        return None if self.process_mtbf_s is None else self.process_mtbf_s / self.num_nodes

    @property
    def takes_memory_snapshots(self) -> bool:
        """Whether the memory tier is on (a process MTBF or a memory step cap is configured)."""
        return self.process_mtbf_s is not None or self.memory_every_n_train_steps_max is not None

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
        process_mtbf: Union[Duration, None] = None,
        memory_every_n_train_steps_max: Optional[int] = None,
        process_mtbf_prior: Optional[Duration] = None,
        memory_initial_cost: Duration = DEFAULT_MEMORY_INITIAL_COST,
    ) -> ScheduleConfig:
        """Build from user-facing values (durations as ``"24h"``, seconds or ``timedelta``).

        ``mtbf="observed"`` estimates M from the failure history with ``mtbf_prior`` as prior.
        ``process_mtbf`` (M1, per node) turns the memory tier on with the two-level schedule;
        ``process_mtbf="observed"`` estimates it from the history (process failures: resumes from
        the memory tier) with ``process_mtbf_prior`` as prior. ``mtbf`` stays the node MTBF (M2).
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

        observed = _is_observed(mtbf)
        mtbf_s = optional_seconds(mtbf_prior if observed else mtbf, "mtbf_prior" if observed else "mtbf")
        p_observed = _is_observed(process_mtbf)
        process_s = optional_seconds(
            process_mtbf_prior if p_observed else process_mtbf, "process_mtbf_prior" if p_observed else "process_mtbf"
        )
        memory_initial_cost_s = seconds(memory_initial_cost, "memory_initial_cost")
        min_interval_s = seconds(min_interval, "min_interval")
        max_interval_s = seconds(max_interval, "max_interval")
        initial_cost_s = seconds(initial_cost, "initial_cost")
        check_interval_s = seconds(check_interval, "check_interval")
        if observed and mtbf_s is None and problems:
            mtbf_s = 1.0  # the bad prior is already reported
        if p_observed and process_s is None and problems:
            process_s = 1.0
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
                process_mtbf_s=process_s,
                memory_every_n_train_steps_max=memory_every_n_train_steps_max,
                process_mtbf_mode=MtbfMode.OBSERVED if p_observed else MtbfMode.CONFIGURED,
                memory_initial_cost_s=memory_initial_cost_s,
            )
        except ConfigurationError as err:
            raise ConfigurationError("ScheduleConfig", problems + err.problems) from None
        if problems:
            raise ConfigurationError("ScheduleConfig", problems)
        return config

    def with_nodes(self, num_nodes: int) -> ScheduleConfig:
        """The same options for ``num_nodes`` nodes (known only once the trainer is set up)."""
        return dataclasses.replace(self, num_nodes=num_nodes)


def _is_observed(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == MtbfMode.OBSERVED.value


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


# --------------------------------------------------------------------------------------------
# Two-level state machine (memory tier + durable tier)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TierDecision:
    """Rank 0's two-level answer at a check: which tier to snapshot to now (``Tier.NONE``: none),
    why, and the step of the next check (broadcast with it, as in ``SaveDecision``)."""

    tier: Tier
    reason: SaveReason
    next_check_step: int


@dataclass(frozen=True)
class MemoryState:
    """What the memory tier's schedule remembers, next to the durable ``ScheduleState``.

    ``process_mtbf_s``: the job's M1 (``None``: no process MTBF, only a step cap paces the tier).
    ``anchor_time`` / ``anchor_step``: the end of the newest snapshot of *either* tier (a durable
    save is also that step's memory snapshot). ``costs``: recent measured C1, newest last.
    ``since_durable``: memory snapshots since the newest durable save; ``durable_step``: that save's
    step (``None`` before the first one of this process).
    """

    process_mtbf_s: Optional[float]
    anchor_time: float
    anchor_step: int
    costs: tuple = ()
    since_durable: int = 0
    durable_step: Optional[int] = None
    snapshots: int = 0


def start_memory(
    config: ScheduleConfig,
    now: float,
    step: int,
    process_mtbf_s: Optional[float] = None,
    restored: Optional[Mapping[str, Any]] = None,
) -> MemoryState:
    """The memory tier's state at the start of a process; ``restored`` as in ``start_schedule``
    (keys ``memory_costs``, ``memory_snapshots`` of ``memory_state_dict``)."""
    restored = restored or {}
    m1 = config.job_process_mtbf_s if process_mtbf_s is None else float(process_mtbf_s)
    return MemoryState(
        process_mtbf_s=m1,
        anchor_time=float(now),
        anchor_step=int(step),
        costs=tuple(float(c) for c in restored.get("memory_costs", ()))[-COST_WINDOW:],
        snapshots=int(restored.get("memory_snapshots", 0)),
    )


def memory_state_dict(memory: MemoryState) -> dict:
    """The part of the memory tier's state worth keeping across a restart (JSON-friendly)."""
    return {"memory_costs": list(memory.costs), "memory_snapshots": memory.snapshots}


def memory_cost_estimate(state: ScheduleState, memory: MemoryState) -> float:
    """C1: the median of the recent measured memory-snapshot costs, or the conservative guess."""
    return statistics.median(memory.costs) if memory.costs else state.config.memory_initial_cost_s


def current_plan(state: ScheduleState, memory: MemoryState) -> Optional[TwoLevelPlan]:
    """The unclamped two-level optimum for the current C1, C2, M1, M2 (``None`` unless both MTBFs are known)."""
    if memory.process_mtbf_s is None or state.mtbf_s is None:
        return None
    return two_level_plan(
        memory_cost_estimate(state, memory), cost_estimate(state), memory.process_mtbf_s, state.mtbf_s
    )


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
        c1, c2, m1, m2 = memory_cost_estimate(state, memory), cost_estimate(state), memory.process_mtbf_s, state.mtbf_s
        k_real = math.sqrt(2.0 * c2 * m2) / t1
        candidates = {max(1, math.floor(k_real)), max(1, math.ceil(k_real))}
        k = min(sorted(candidates), key=lambda n: two_level_waste(t1, n, c1, c2, m1, m2))
    return max(1, min(k, math.floor(state.config.max_interval_s / t1)))


def _durable_reason(state: ScheduleState, memory: MemoryState, now: float, step: int) -> Optional[SaveReason]:
    """Why a durable save is due regardless of the memory tier (cap, first measurement, max interval)."""
    cfg = state.config
    if state.write_started_at is not None:
        return None
    cap = cfg.every_n_train_steps_max
    if cap is not None and step - state.anchor_step >= cap:
        return SaveReason.STEP_CAP
    if durable_every(state, memory) is None:  # no plan: the durable tier is single-level
        decision = should_save(state, now, step)
        return decision.reason if decision.save else None
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


def should_snapshot(state: ScheduleState, memory: Optional[MemoryState], now: float, step: int) -> TierDecision:
    """Rank 0's two-level decision at a check. Without a memory tier (``memory`` is ``None`` or the
    config has none) this is ``should_save`` with ``save`` mapped to ``Tier.DURABLE``.

    With one: a durable save when the durable tier's own triggers fire (its step cap, its first
    measurement, max_interval since the last durable save; or, with no two-level plan because the
    node MTBF is off, its single-level schedule), or when the memory snapshot due now is the k-th
    since the last durable save (and no async write is in flight); else a memory snapshot when T1
    (or the memory step cap) has passed since the newest snapshot of either tier. The first memory
    snapshot is never promoted to durable: it measures C1, which the plan's k depends on.
    """
    if memory is None or not state.config.takes_memory_snapshots:
        d = should_save(state, now, step)
        return TierDecision(Tier.DURABLE if d.save else Tier.NONE, d.reason, d.next_check_step)
    durable = _durable_reason(state, memory, now, step)
    if durable is not None:
        return TierDecision(Tier.DURABLE, durable, step + 1)
    reason = _memory_reason(state, memory, now, step)
    if reason is not None:
        k = durable_every(state, memory)
        measuring = (
            reason is SaveReason.MEMORY_FIRST_MEASUREMENT
        )  # else a guessed C1 giving k = 1 would never be measured
        if k is not None and not measuring and state.write_started_at is None and memory.since_durable + 1 >= k:
            return TierDecision(Tier.DURABLE, SaveReason.EVERY_KTH, step + 1)
        return TierDecision(Tier.MEMORY, reason, step + 1)
    idle = SaveReason.WRITE_IN_FLIGHT if state.write_started_at is not None else SaveReason.NOT_DUE
    return TierDecision(Tier.NONE, idle, _next_tier_check(state, memory, now, step))


def record_memory_snapshot(memory: MemoryState, now: float, step: int, blocked_s: float) -> MemoryState:
    """The memory tier's state after a memory snapshot whose blocking part ended at ``now``.

    At the step of the newest durable save (the mechanism refreshing the memory copy of that save)
    only the cost is recorded: that snapshot was already counted as the durable one."""
    if not (math.isfinite(blocked_s) and blocked_s >= 0):
        raise ValueError(f"blocked_s={blocked_s!r} must be a finite number of seconds >= 0")
    costs = (memory.costs + (float(blocked_s),))[-COST_WINDOW:]
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


def two_level_waste_now(state: ScheduleState, memory: MemoryState) -> Optional[float]:
    """First-order expected waste at the clamped T1 and applied k (``None`` without a plan)."""
    t1, k = memory_interval(state, memory), durable_every(state, memory)
    if t1 is None or k is None or memory.process_mtbf_s is None or state.mtbf_s is None:
        return None
    return two_level_waste(
        t1, k, memory_cost_estimate(state, memory), cost_estimate(state), memory.process_mtbf_s, state.mtbf_s
    )
