"""The run's failure history: a small JSON file next to the checkpoints, and the M it implies.

Each resume appends one event (when the process restarted, the time of the snapshot it resumed
from, the time lost, the interval since the previous failure, whether the previous process
died or stopped cleanly, and which tier it resumed from). A failure resumed from the memory tier
is a *process failure* (the machine survived: its shared memory still held the snapshot); any
other failure is counted as a *node failure* (the conservative reading of a disk resume, and of
events written before tiers were recorded). ``mtbf="observed"`` turns that history into the job's M with
``estimate_mtbf``. The record functions and the estimate are pure (clock passed in); only
``load_history`` / ``save_history`` touch the file, and they never take training down: a corrupt
or unreadable file gives a ``HistoryWarning`` and a fresh history, a failed write a warning.
Times are wall-clock seconds since the epoch (``time.time()``), since they span processes.
This module knows nothing about Lightning; rank 0 alone should read and write the file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping, Optional

from lightning_resume import storage
from lightning_resume.errors import HistoryWarning
from lightning_resume.io.atomic import atomic_write
from lightning_resume.schedule.state import Tier

HISTORY_FILENAME = "resume_history.json"
FORMAT_VERSION = 1


class EventKind(str, Enum):
    FAILURE = "failure"  # the previous process died without a clean stop (crash, kill, node loss)
    CLEAN_STOP = "clean_stop"  # the previous process stopped cleanly (preemption snapshot, end of fit)


@dataclass(frozen=True)
class ResumeEvent:
    """One resume. ``lost_s`` = restart time - time of the snapshot resumed from (redone work plus
    downtime); ``uptime_s`` = how long the ended process ran, counted (conservatively, for a
    failure) up to that snapshot; ``interval_s`` = time since the previous failure's restart, or the run start.
    ``tier``: the tier resumed from (``None``: not recorded, as in files written before tiers)."""

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

    def life_start(self) -> Optional[float]:
        """When the current process (life) started."""
        return self.events[-1].restart_time if self.events else self.run_start


def history_path(dirpath: str) -> str:
    """``dirpath/resume_history.json``; a URL (``s3://...``) keeps its scheme."""
    return storage.join(os.fspath(dirpath), HISTORY_FILENAME)


# --------------------------------------------------------------------------------------------
# Pure updates and the estimate
# --------------------------------------------------------------------------------------------


def record_start(
    history: FailureHistory, now: float, checkpoint_time: Optional[float], tier: Optional[Tier] = None
) -> FailureHistory:
    """The history once a process starts at ``now``.

    ``checkpoint_time`` is when the snapshot being resumed from was taken, or ``None`` for a fresh
    run (which starts a new history: an old one described another run). ``tier`` is the tier it
    came from (``Tier.MEMORY`` or ``Tier.DURABLE``; ``None`` if unknown).
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
        lost_s=max(0.0, now - checkpoint_time),
        interval_s=max(0.0, now - previous_failure),
        uptime_s=max(0.0, end - start),
        kind=kind,
        tier=None if tier is None else Tier(tier),
    )
    run_start = history.run_start if history.run_start is not None else start
    return FailureHistory(run_start=run_start, events=history.events + (event,), clean_stop_time=None)


def record_clean_stop(history: FailureHistory, now: float) -> FailureHistory:
    """The history once the current process stops cleanly (preemption snapshot durable, or fit done)."""
    return dataclasses.replace(history, clean_stop_time=float(now))


def exposure_s(history: FailureHistory, now: float) -> float:
    """Total run time observed: the ended lives' uptimes plus the current life so far."""
    start = history.life_start()
    current = 0.0 if start is None else max(0.0, now - start)
    return sum(e.uptime_s for e in history.events) + current


def estimate_mtbf(history: FailureHistory, prior_mtbf_s: float, prior_weight: float, now: float) -> float:
    """The job's M from the history, with ``prior_mtbf_s`` worth ``prior_weight`` failures.

    Gamma-Exponential conjugate update: with a Gamma(w, w*M0) prior on the failure rate, after
    ``n`` failures in ``S`` seconds of exposure the posterior mean rate is (w + n) / (w*M0 + S), so
    M = (w*M0 + S) / (w + n): the prior's pseudo-failures blended with observed ones. With no
    failures M grows with the time survived; with many, it tends to S / n. Uptime ended by a
    failure is counted only up to the snapshot resumed from, which errs towards a shorter M (more
    frequent saves) rather than counting queue time as survival.
    """
    return _posterior_mtbf(len(history.failures), history, prior_mtbf_s, prior_weight, now)


def estimate_process_mtbf(history: FailureHistory, prior_mtbf_s: float, prior_weight: float, now: float) -> float:
    """The job's M1 (process failures: resumed from the memory tier), as ``estimate_mtbf``."""
    return _posterior_mtbf(len(history.process_failures), history, prior_mtbf_s, prior_weight, now)


def estimate_node_mtbf(history: FailureHistory, prior_mtbf_s: float, prior_weight: float, now: float) -> float:
    """The job's M2 (node failures: every other failure), as ``estimate_mtbf``."""
    return _posterior_mtbf(len(history.node_failures), history, prior_mtbf_s, prior_weight, now)


def _posterior_mtbf(n: int, history: FailureHistory, prior_mtbf_s: float, prior_weight: float, now: float) -> float:
    if not (math.isfinite(prior_mtbf_s) and prior_mtbf_s > 0):
        raise ValueError(f"prior_mtbf_s={prior_mtbf_s!r} must be > 0 seconds")
    if not (math.isfinite(prior_weight) and prior_weight > 0):
        raise ValueError(f"prior_weight={prior_weight!r} must be > 0 pseudo-failures")
    return (prior_weight * prior_mtbf_s + exposure_s(history, now)) / (prior_weight + n)


# --------------------------------------------------------------------------------------------
# The file
# --------------------------------------------------------------------------------------------


def history_to_json(history: FailureHistory) -> dict:
    # "tier" is an extra key of version 1: readers that predate it ignore it, and a missing one reads as None
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


def _number(obj: Mapping[str, Any], key: str) -> float:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key}={value!r} is not a finite number")
    return float(value)


def _optional_number(obj: Mapping[str, Any], key: str) -> Optional[float]:
    return None if obj[key] is None else _number(obj, key)


def history_from_json(data: Any) -> FailureHistory:
    """Parse the file's JSON; ``ValueError`` / ``KeyError`` / ``TypeError`` on anything malformed."""
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
        raise ValueError(f"not a version-{FORMAT_VERSION} resume history")
    if not isinstance(data["events"], list):
        raise ValueError("events is not a list")
    events = tuple(
        ResumeEvent(
            restart_time=_number(e, "restart_time"),
            checkpoint_time=_number(e, "checkpoint_time"),
            lost_s=_number(e, "lost_s"),
            interval_s=_number(e, "interval_s"),
            uptime_s=_number(e, "uptime_s"),
            kind=EventKind(e["kind"]),
            tier=None if e.get("tier") is None else Tier(e["tier"]),
        )
        for e in data["events"]
    )
    return FailureHistory(
        run_start=_optional_number(data, "run_start"),
        events=events,
        clean_stop_time=_optional_number(data, "clean_stop_time"),
    )


def load_history(path: str) -> FailureHistory:
    """The history stored at ``path``; a fresh one if it is missing, or (with a warning) unreadable."""
    try:
        return history_from_json(json.loads(storage.read_bytes(str(path)).decode("utf-8")))
    except FileNotFoundError:
        return FailureHistory()
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
        warnings.warn(
            f"{path}: unreadable resume history ({type(err).__name__}: {err}); starting a fresh one. "
            "Observed-MTBF estimates restart from the prior; delete the file to silence this.",
            HistoryWarning,
            stacklevel=2,
        )
        return FailureHistory()


def save_history(path: str, history: FailureHistory) -> bool:
    """Write atomically (temp file, fsync, ``os.replace``, directory fsync). Returns ``False`` and
    warns on an OS error (disk full, permissions): losing the history must not stop training."""
    data = json.dumps(history_to_json(history), indent=1, sort_keys=True).encode("utf-8")
    try:
        atomic_write(path, lambda f: f.write(data))
        return True
    except OSError as err:
        warnings.warn(
            f"{path}: could not write the resume history ({err}); training continues without it.",
            HistoryWarning,
            stacklevel=2,
        )
        return False
