"""The optimal-interval formulas: Young's and Daly's single-level intervals, the expected-waste
models, the two-level (memory + durable tier) optimum and the three-level one (memory, replicas on
peer nodes, durable).

Pure math over seconds: no configuration, no state, no clock, no Lightning, no files. ``config``
validates the options these are applied with; ``state`` (the schedule state machine) and the
``plan`` command apply them.

Conventions (as in Daly 2006): an *interval* is training time between the end of one save's
blocking part and the start of the next save; ``c`` is the time training is blocked by one save
(for async saves the snapshot copy only); ``m`` is the job's mean time between failures
(per-node MTBF divided by the number of nodes).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Mapping, Optional


class Formula(str, Enum):
    """Which optimal-interval formula the schedule uses."""

    YOUNG = "young"  # T* = sqrt(2CM), Young 1974: first order, fine while C << M
    DALY = "daly"  # Daly 2006 higher-order estimate: better when C is a sizeable fraction of M


def _check_inputs(costs: Mapping[str, float], mtbfs: Mapping[str, float]) -> None:
    for name, c in costs.items():
        if not (math.isfinite(c) and c >= 0):
            raise ValueError(f"checkpoint cost {name}={c!r} must be a finite number of seconds >= 0")
    for name, m in mtbfs.items():
        if not (math.isfinite(m) and m > 0):
            raise ValueError(f"mean time between failures {name}={m!r} must be a finite number of seconds > 0")


def _check_interval(name: str, t: float) -> None:
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"interval {name}={t!r} must be a finite number of seconds > 0")


def _check_cost_mtbf(c: float, m: float) -> None:
    _check_inputs({"c": c}, {"m": m})


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
    _check_interval("t", t)
    exponent = (t + c + restart_s) / m
    if exponent > 700.0:  # e^700 is near float max: a failure-free segment is hopeless
        return 1.0
    wall = m * math.exp(restart_s / m) * math.expm1((t + c) / m)
    return max(0.0, 1.0 - t / wall)


def first_order_waste(t: float, c: float, m: float) -> float:
    """Young's first-order waste model ``c/t + t/(2m)`` (can exceed 1 when c/m is large)."""
    _check_cost_mtbf(c, m)
    _check_interval("t", t)
    return c / t + t / (2.0 * m)


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
    _check_inputs({"c1": c1, "c2": c2}, {"m1": m1, "m2": m2})


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
    _check_interval("t1", t1)
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


# The three-level model (memory tier + replicas on peer nodes + durable tier)


@dataclass(frozen=True)
class Levels:
    """The inputs of the three-level model, seconds, job-wide.

    Costs: ``c1`` a memory snapshot's blocking time; ``c2`` the training time a replica transfer costs
    (it runs in the background: only the steps it slows down); ``d2`` a replica transfer's duration,
    from the snapshot's end until the peers hold it; ``c3`` a durable save's extra blocking time.
    MTBFs: ``m1`` of process losses (the node survives: back to the newest memory snapshot), ``m2`` of
    node losses (back to the newest replica), ``m3`` of whole-job losses (back to the newest durable save).
    """

    c1: float
    c2: float
    d2: float
    c3: float
    m1: float
    m2: float
    m3: float

    def __post_init__(self) -> None:
        _check_inputs(
            {"c1": self.c1, "c2": self.c2, "d2": self.d2, "c3": self.c3}, {"m1": self.m1, "m2": self.m2, "m3": self.m3}
        )

    def without_replicas(self) -> tuple[float, float, float, float]:
        """(C1, C2, M1, M2) of the two-level model the same job has with no replica: a node loss goes back
        to the durable tier, so the two-level ``M2`` merges node and job losses."""
        return self.c1, self.c3, self.m1, 1.0 / (1.0 / self.m2 + 1.0 / self.m3)


@dataclass(frozen=True)
class ThreeLevelPlan(TwoLevelPlan):
    """A plan for a job that can keep replicas: a memory snapshot every ``t1`` seconds, every ``k``-th one
    durable; ``replicate``: whether each snapshot is also sent to the peers (when it does not pay, the
    plan is the two-level one for node and job losses both sent back to the durable tier)."""

    replicate: bool = False


def three_level_waste(t1: float, k: int, levels: Levels) -> float:
    """First-order expected waste of replicating every memory snapshot taken every ``t1``, every
    ``k``-th one durable:

    ``(C1 + C2)/T1 + C3/(k T1) + T1/(2 M1) + (T1 + (k - 1) w)/(2 M2) + k T1/(2 M3)``, ``w = min(D2, T1)``.

    The multi-level model of Moody et al. (SC'10, SCR's "partner" level: a copy of each node's checkpoint
    on another node) and Di et al. (IPDPS'14), first order as Young's, with one level per failure class,
    and two changes for how this replica mechanism works. (1) Each rank keeps one memory snapshot and
    each peer one replica of it, so a replica helps only while it is of the newest snapshot: every
    snapshot is replicated (replicating every j-th one would leave the others without a usable replica),
    and the replica interval is ``T1``. (2) The transfer runs in the background for ``D2`` seconds after a
    snapshot; a node lost before it lands finds the peers holding the previous snapshot and the survivors
    the new one, no common step, so it goes back to the durable tier. Over a memory interval (a node loss
    at a uniform time ``u`` in it, the interval uniform in its durable cycle) that costs
    ``u + (k - 1) T1 / 2`` on average for ``u < w`` and ``u`` otherwise: ``T1/2 + (k - 1) w / 2``. With
    ``D2 >= T1`` a replica never lands before the next snapshot and the model is the two-level one with
    node and job losses sent to disk; with ``C2 = D2 = 0`` it is the two-level one with process and node
    losses both sent to memory.
    """
    _check_interval("t1", t1)
    if isinstance(k, bool) or int(k) != k or k < 1:
        raise ValueError(f"k={k!r} must be an integer >= 1 (durable every k-th memory snapshot)")
    lv, w = levels, min(levels.d2, t1)
    node = (t1 + (k - 1) * w) / (2.0 * lv.m2)
    return (lv.c1 + lv.c2) / t1 + lv.c3 / (k * t1) + t1 / (2.0 * lv.m1) + node + k * t1 / (2.0 * lv.m3)


def three_level_t1(k: int, levels: Levels) -> float:
    """The best ``T1`` for a fixed ``k`` among ``T1 >= D2`` (shorter ones leave no usable replica):
    ``max(D2, sqrt((C1 + C2 + C3/k) / (1/(2 M1) + 1/(2 M2) + k/(2 M3))))``."""
    lv = levels
    rate = 1.0 / (2.0 * lv.m1) + 1.0 / (2.0 * lv.m2) + k / (2.0 * lv.m3)
    return max(lv.d2, math.sqrt((lv.c1 + lv.c2 + lv.c3 / k) / rate))


def three_level_k(t1: float, levels: Levels) -> int:
    """The best ``k`` for a given ``T1`` (one the scheduler clamped): the integer neighbours of
    ``sqrt(C3 / (T1 (T1/(2 M3) + w/(2 M2))))``, which minimises the ``k`` terms of the waste."""
    _check_interval("t1", t1)
    lv = levels
    slope = t1 * (t1 / (2.0 * lv.m3) + min(lv.d2, t1) / (2.0 * lv.m2))
    k_real = min(float(MAX_K), math.sqrt(lv.c3 / slope)) if lv.c3 > 0 and slope > 0 else 1.0
    if lv.c3 > 0 and slope <= 0:  # underflow: durable saves as rarely as allowed
        k_real = float(MAX_K)
    candidates = {min(MAX_K, max(1, math.floor(k_real))), min(MAX_K, max(1, math.ceil(k_real)))}
    return min(sorted(candidates), key=lambda n: three_level_waste(t1, n, lv))


def _k_candidates(levels: Levels) -> list[int]:
    """The ``k`` to try: every one up to 256, then a 2 % geometric grid to ``MAX_K``, and the integer
    neighbours of the optimum at ``T1 = D2`` (where the waste need not be unimodal in ``k``)."""
    ks = set(range(1, 257))
    x = 256.0
    while x < MAX_K:
        x *= 1.02
        ks.add(min(MAX_K, int(x)))
    if levels.d2 > 0:
        ks.add(three_level_k(levels.d2, levels))
    return sorted(ks)


@functools.lru_cache(maxsize=256)  # pure; the scheduler asks again at every check with the same estimates
def three_level_plan(levels: Levels) -> ThreeLevelPlan:
    """The optimal plan for ``levels``: the better of replicating every memory snapshot (``T1`` and ``k``
    minimising ``three_level_waste``) and not replicating (``two_level_plan`` of
    ``levels.without_replicas()``); a tie keeps the replicas off (nothing sent for nothing).

    ``k`` has no closed form here (the in-flight term ``(k - 1) D2 / (2 M2)`` grows with it), so each
    candidate of ``_k_candidates`` is tried at its own best ``T1``; the waste of the best is refined on the
    candidates' neighbours. Unclamped: the scheduler applies ``min_interval`` / ``max_interval``."""
    two = two_level_plan(*levels.without_replicas())
    best = ThreeLevelPlan(t1=two.t1, k=two.k, waste=two.waste, replicate=False)
    replicated = _best_replicated(levels, _k_candidates(levels))
    if replicated is not None and replicated.k > 256:  # between two grid points: try every integer near it
        near = range(max(257, int(replicated.k / 1.03)), min(MAX_K, int(replicated.k * 1.03) + 1) + 1)
        replicated = _best_replicated(levels, near)
    return replicated if replicated is not None and replicated.waste < best.waste else best


def _best_replicated(levels: Levels, ks: Iterable[int]) -> Optional[ThreeLevelPlan]:
    """The best replicating plan among ``ks`` (each at its own best ``T1``); ``None`` when every cost is 0."""
    best: Optional[ThreeLevelPlan] = None
    for k in ks:
        t1 = three_level_t1(k, levels)
        if t1 <= 0:
            continue
        waste = three_level_waste(t1, k, levels)
        if best is None or waste < best.waste:
            best = ThreeLevelPlan(t1=t1, k=k, waste=waste, replicate=True)
    return best
