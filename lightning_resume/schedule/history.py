"""The run's failure history, carried inside every checkpoint, and the M it implies.

Each resume appends one event (when the process restarted, the time of the snapshot it resumed
from, the time lost, the interval since the previous failure, whether the previous process
died or stopped cleanly, and which tier it resumed from). A failure resumed from the memory tier
is a *process failure* (the machine survived: its shared memory still held the snapshot); any
other failure is counted as a *node failure* (the conservative reading of a disk resume, or of a
resume whose tier is unknown). ``mtbf="observed"`` turns that history into the job's M with
``estimate_mtbf``. With replicas (the three-level schedule) a failure resumed from a peer's replica
(``Tier.REPLICA``) is a *node loss* and one resumed from the durable tier (or of unknown tier) a *whole-job
loss*: it lost what replicas protect against, whatever the cause (every node's memory, a node and its
replica holder, a node lost while its replica was in flight, a replica refused by its digest), and the
durable tier is what it cost. Without replicas a durable resume stays a node failure as before (the
two-level M2 prices node and job losses together). Everything here is pure (clock passed in): the scheduler stores
``history_to_json`` in the checkpoint's schedule state and reads it back with ``read_history``.
The ``history`` entry of the checkpoint resumed from is untrusted input: ``read_history`` checks every
value (finite, non-negative, durations at most ``MAX_DURATION_S``), keeps the newest ``MAX_EVENTS``
events and never raises (a bad history gives a ``HistoryWarning`` and a fresh one), and the estimate
clamps what it returns, so no history can make the schedule fail.
Times are wall-clock seconds since the epoch (``time.time()``), since they span processes.
This module knows nothing about Lightning or files.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping, Optional, Sequence

from lightning_resume.errors import HistoryWarning
from lightning_resume.schedule.state import Tier

FORMAT_VERSION = 1

MAX_DURATION_S = 100 * 365.25 * 24 * 3600.0
"""The longest uptime, loss or interval a history holds (100 years): anything longer is corrupt."""

MAX_EVENTS = 10_000
"""Events a history keeps: the newest; older ones are dropped, so the estimate reads the newest
``MAX_EVENTS`` lives (a run that restarted that often has evidence enough without them)."""

MIN_MTBF_S = 1e-3
"""The floor of an estimated M (a millisecond): with the ceiling ``MAX_DURATION_S``, the range in which
the interval formulas are defined for any history."""

_FLOAT_MAX = sys.float_info.max


class EventKind(str, Enum):
    FAILURE = "failure"  # the previous process died without a clean stop (crash, kill, node loss)
    CLEAN_STOP = "clean_stop"  # the previous process stopped cleanly (preemption snapshot, end of fit)


@dataclass(frozen=True)
class ResumeEvent:
    """One resume. ``lost_s`` = restart time - time of the snapshot resumed from (redone work plus
    downtime); ``uptime_s`` = how long the ended process ran, counted (conservatively, for a
    failure) up to that snapshot; ``interval_s`` = time since the previous failure's restart, or the run start.
    ``tier``: the tier resumed from (``None``: unknown)."""

    restart_time: float
    checkpoint_time: float
    lost_s: float
    interval_s: float
    uptime_s: float
    kind: EventKind
    tier: Optional[Tier] = None

    @property
    def process_failure(self) -> bool:
        """A failure the machine survived: the resume came from the memory tier."""
        return self.kind is EventKind.FAILURE and self.tier is Tier.MEMORY

    @property
    def node_failure(self) -> bool:
        """Any other failure (a disk resume after an unclean stop, or tier unknown)."""
        return self.kind is EventKind.FAILURE and self.tier is not Tier.MEMORY

    @property
    def node_loss(self) -> bool:
        """With replicas: a failure resumed from a peer node's replica (its own node was lost)."""
        return self.kind is EventKind.FAILURE and self.tier is Tier.REPLICA

    @property
    def job_loss(self) -> bool:
        """With replicas: a failure neither memory nor a replica covered (a durable resume, or tier unknown)."""
        return self.kind is EventKind.FAILURE and self.tier not in (Tier.MEMORY, Tier.REPLICA)


@dataclass(frozen=True)
class FailureHistory:
    """``run_start``: when the first process started; ``clean_stop_time``: set by the current
    process when it stops cleanly, so the next resume knows it was no failure."""

    run_start: Optional[float] = None
    events: tuple = ()
    clean_stop_time: Optional[float] = None

    @property
    def failures(self) -> tuple:
        return tuple(e for e in self.events if e.kind is EventKind.FAILURE)

    @property
    def process_failures(self) -> tuple:
        """Failures resumed from the memory tier (the node survived)."""
        return tuple(e for e in self.events if e.process_failure)

    @property
    def node_failures(self) -> tuple:
        """Failures resumed from the durable tier (or of unknown tier)."""
        return tuple(e for e in self.events if e.node_failure)

    @property
    def node_losses(self) -> tuple:
        """Failures resumed from a peer's replica."""
        return tuple(e for e in self.events if e.node_loss)

    @property
    def job_losses(self) -> tuple:
        """Failures resumed from neither memory nor a replica."""
        return tuple(e for e in self.events if e.job_loss)

    def life_start(self) -> Optional[float]:
        """When the current process (life) started."""
        return self.events[-1].restart_time if self.events else self.run_start


# --------------------------------------------------------------------------------------------
# Pure updates and the estimate
# --------------------------------------------------------------------------------------------


def record_start(
    history: FailureHistory, now: float, checkpoint_time: Optional[float], tier: Optional[Tier] = None
) -> FailureHistory:
    """The history once a process starts at ``now``.

    ``checkpoint_time`` is when the snapshot being resumed from was taken, or ``None`` for a fresh
    run (which starts a new history: an old one described another run). ``tier`` is the tier it
    came from (``Tier.MEMORY``, ``Tier.REPLICA`` or ``Tier.DURABLE``; ``None`` if unknown).
    """
    if checkpoint_time is None:
        return FailureHistory(run_start=float(now))
    start = history.life_start()
    if start is None:  # history lost: the run lived at least until the snapshot
        start = checkpoint_time
    clean = history.clean_stop_time
    kind = EventKind.FAILURE if clean is None else EventKind.CLEAN_STOP
    end = checkpoint_time if clean is None else clean
    previous_failure = history.failures[-1].restart_time if history.failures else (history.run_start or start)
    event = ResumeEvent(
        restart_time=float(now),
        checkpoint_time=float(checkpoint_time),
        lost_s=clamp_duration(now - checkpoint_time),
        interval_s=clamp_duration(now - previous_failure),
        uptime_s=clamp_duration(end - start),
        kind=kind,
        tier=None if tier is None else Tier(tier),
    )
    run_start = history.run_start if history.run_start is not None else start
    return FailureHistory(run_start=run_start, events=newest(history.events + (event,)), clean_stop_time=None)


def newest(events: Sequence[Any]) -> tuple:
    """The events a history keeps: the newest ``MAX_EVENTS``."""
    return tuple(events[-MAX_EVENTS:])


def clamp_duration(seconds: float) -> float:
    """``seconds`` within [0, ``MAX_DURATION_S``], NaN as 0: how a duration computed from a clock that
    jumped, or from a record read back, is counted."""
    return 0.0 if math.isnan(seconds) else min(max(seconds, 0.0), MAX_DURATION_S)


def is_wall_time(value: Any) -> bool:
    """Whether ``value`` can be a wall time of the history: a finite number of seconds >= 0."""
    return _in_range(value, _FLOAT_MAX)


def record_clean_stop(history: FailureHistory, now: float) -> FailureHistory:
    """The history once the current process stops cleanly (preemption snapshot durable, or fit done)."""
    return dataclasses.replace(history, clean_stop_time=float(now))


def exposure_s(history: FailureHistory, now: float) -> float:
    """Total run time observed: the ended lives' uptimes plus the current life so far."""
    start = history.life_start()
    current = 0.0 if start is None else clamp_duration(now - start)
    return sum(clamp_duration(e.uptime_s) for e in history.events) + current


def estimate_mtbf(history: FailureHistory, prior_mtbf_s: float, prior_weight: float, now: float) -> float:
    """The job's M from the history, with ``prior_mtbf_s`` worth ``prior_weight`` failures.

    Gamma-Exponential conjugate update: with a Gamma(w, w*M0) prior on the failure rate, after
    ``n`` failures in ``S`` seconds of exposure the posterior mean rate is (w + n) / (w*M0 + S), so
    M = (w*M0 + S) / (w + n): the prior's pseudo-failures blended with observed ones. With no
    failures M grows with the time survived; with many, it tends to S / n. Uptime ended by a
    failure is counted only up to the snapshot resumed from, which errs towards a shorter M (more
    frequent saves) rather than counting queue time as survival.

    Whatever the history holds, M is finite, within [``MIN_MTBF_S``, ``MAX_DURATION_S``]: each
    uptime counts within [0, ``MAX_DURATION_S``], so no record can make the interval formulas fail.
    """
    return _posterior_mtbf(len(history.failures), history, prior_mtbf_s, prior_weight, now)


def estimate_process_mtbf(history: FailureHistory, prior_mtbf_s: float, prior_weight: float, now: float) -> float:
    """The job's M1 (process failures: resumed from the memory tier), as ``estimate_mtbf``."""
    return _posterior_mtbf(len(history.process_failures), history, prior_mtbf_s, prior_weight, now)


def estimate_node_mtbf(history: FailureHistory, prior_mtbf_s: float, prior_weight: float, now: float) -> float:
    """The job's M2 (node failures: every other failure), as ``estimate_mtbf``."""
    return _posterior_mtbf(len(history.node_failures), history, prior_mtbf_s, prior_weight, now)


def estimate_node_loss_mtbf(history: FailureHistory, prior_mtbf_s: float, prior_weight: float, now: float) -> float:
    """With replicas: the job's M2 (node losses: resumed from a peer's replica), as ``estimate_mtbf``."""
    return _posterior_mtbf(len(history.node_losses), history, prior_mtbf_s, prior_weight, now)


def estimate_job_loss_mtbf(history: FailureHistory, prior_mtbf_s: float, prior_weight: float, now: float) -> float:
    """With replicas: the job's M3 (whole-job losses: resumed from the durable tier), as ``estimate_mtbf``."""
    return _posterior_mtbf(len(history.job_losses), history, prior_mtbf_s, prior_weight, now)


def _posterior_mtbf(n: int, history: FailureHistory, prior_mtbf_s: float, prior_weight: float, now: float) -> float:
    if not (math.isfinite(prior_mtbf_s) and prior_mtbf_s > 0):
        raise ValueError(f"prior_mtbf_s={prior_mtbf_s!r} must be > 0 seconds")
    if not (math.isfinite(prior_weight) and prior_weight > 0):
        raise ValueError(f"prior_weight={prior_weight!r} must be > 0 pseudo-failures")
    m = (prior_weight * prior_mtbf_s + exposure_s(history, now)) / (prior_weight + n)
    return min(max(m, MIN_MTBF_S), MAX_DURATION_S)  # also an overflowing prior_weight * prior_mtbf_s


# --------------------------------------------------------------------------------------------
# The stored form (the checkpoint's ``history`` entry)
# --------------------------------------------------------------------------------------------


def history_to_json(history: FailureHistory) -> dict:
    events = [
        {**dataclasses.asdict(e), "kind": e.kind.value, "tier": None if e.tier is None else e.tier.value}
        for e in history.events
    ]
    return {
        "version": FORMAT_VERSION,
        "run_start": history.run_start,
        "clean_stop_time": history.clean_stop_time,
        "events": events,
    }


def history_from_json(data: Any) -> FailureHistory:
    """Parse a version-1 history (a checkpoint's ``history`` entry); ``ValueError``
    naming the first thing wrong with it. Strict: ``read_history`` is the reader that never fails."""
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION or isinstance(data["version"], bool):
        raise ValueError(f"not a version-{FORMAT_VERSION} resume history")
    events = data.get("events")
    if not isinstance(events, (list, tuple)):
        raise ValueError(f"events is {_kind(events)}, not a list")
    if len(events) > MAX_EVENTS:
        raise ValueError(f"{len(events)} events, more than the {MAX_EVENTS} a history keeps")
    return FailureHistory(
        run_start=_optional_wall_time(data, "run_start"),
        events=tuple(_event(i, e) for i, e in enumerate(events)),
        clean_stop_time=_optional_wall_time(data, "clean_stop_time"),
    )


def _event(index: int, e: Any) -> ResumeEvent:
    if not isinstance(e, dict):
        raise ValueError(f"event {index} is {_kind(e)}, not an object")
    try:
        return ResumeEvent(
            restart_time=_wall_time(e, "restart_time"),
            checkpoint_time=_wall_time(e, "checkpoint_time"),
            lost_s=_duration(e, "lost_s"),
            interval_s=_duration(e, "interval_s"),
            uptime_s=_duration(e, "uptime_s"),
            kind=EventKind(_choice(e, "kind", EventKind)),
            tier=_optional_tier(e),
        )
    except ValueError as err:
        raise ValueError(f"event {index}: {err}") from err


def _optional_tier(e: Mapping[str, Any]) -> Optional[Tier]:
    if "tier" not in e:
        raise ValueError("no tier")
    return None if e["tier"] is None else Tier(_choice(e, "tier", Tier))


def _wall_time(obj: Mapping[str, Any], key: str) -> float:
    return _seconds(obj, key, _FLOAT_MAX, "a wall time (a finite number of seconds >= 0)")


def _optional_wall_time(obj: Mapping[str, Any], key: str) -> Optional[float]:
    return None if key in obj and obj[key] is None else _wall_time(obj, key)


def _duration(obj: Mapping[str, Any], key: str) -> float:
    return _seconds(obj, key, MAX_DURATION_S, f"a duration in [0, {MAX_DURATION_S:g}] s (100 years)")


def _seconds(obj: Mapping[str, Any], key: str, most: float, what: str) -> float:
    if key not in obj:
        raise ValueError(f"no {key}")
    value = obj[key]
    if not _in_range(value, most):
        raise ValueError(f"{key}={_shown(value)} is not {what}")
    return float(value)


def _in_range(value: Any, most: float) -> bool:
    """A number (not a bool) in [0, ``most``]: compared before any conversion, so a huge integer cannot
    overflow ``float()``, and NaN fails every comparison."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= most


def _choice(obj: Mapping[str, Any], key: str, enum: type[Enum]) -> str:
    value, names = obj.get(key), [m.value for m in enum]
    if not (isinstance(value, str) and value in names):
        shown = repr(value[:40]) if isinstance(value, str) else _kind(value)
        raise ValueError(f"{key}={shown} is not one of {names}")
    return value


def _shown(value: Any) -> str:
    """``value`` for a message: a number as written (a huge integer by its size), anything else by type,
    since the repr of a deeply nested list would itself recurse too deep."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _kind(value)
    if isinstance(value, int) and abs(value) >= 10**20:
        return f"an integer of {value.bit_length()} bits"
    return repr(value)


def _kind(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__}"


def read_history(data: Any, source: str) -> FailureHistory:
    """``data`` as a history, from ``source`` (a checkpoint: untrusted input); never raises.

    More than ``MAX_EVENTS`` events: the newest are kept, with a ``HistoryWarning`` saying how many were
    dropped. Anything else wrong: a ``HistoryWarning`` naming ``source`` and the problem, and a fresh
    history (observed estimates restart from the prior)."""
    events = data.get("events") if isinstance(data, dict) else None
    if isinstance(events, (list, tuple)) and len(events) > MAX_EVENTS:
        warnings.warn(
            f"{source}: the resume history holds {len(events)} events, more than the {MAX_EVENTS} kept; the"
            f" oldest {len(events) - MAX_EVENTS} are dropped (observed MTBF reads the newest {MAX_EVENTS})",
            HistoryWarning,
            stacklevel=2,
        )
        data = {**data, "events": newest(events)}
    try:
        return history_from_json(data)
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError) as err:
        return _fresh(source, f"{type(err).__name__}: {err}")


def _fresh(source: str, problem: str) -> FailureHistory:
    warnings.warn(
        f"{source}: unreadable resume history ({problem}); starting a fresh one: observed-MTBF estimates"
        " restart from the prior, and the next checkpoint carries the fresh history.",
        HistoryWarning,
        stacklevel=3,
    )
    return FailureHistory()
