"""C2 measured: the training time a replica transfer costs, from the step durations it overlapped.

A replica transfer runs in the background (``memory.replicate``) and costs training only through the steps it
slows. Each training step's duration (our own snapshots' blocking time left out: that is C1 and C3) is recorded
with the transfer it overlapped, if any (:func:`overlapped`). A transfer's cost is the extra time of its steps over
calm ones, summed over the transfer: ``sum(durations) - n * median(calm)``, floored at 0. The estimate is the median
of the recent transfers' costs, over bounded windows (``STEP_WINDOW`` calm steps, ``TRANSFER_WINDOW`` transfers),
so one slow step (a validation run, a log flush) or one slow transfer does not move it. Nothing is measured until
both a calm step and a finished transfer were seen (``None``: the caller keeps its prior).

Pure: frozen values and functions over observed durations; no clock, no threads, no Lightning.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Optional

STEP_WINDOW = 64
"""How many recent calm step durations the calm median is taken over."""

TRANSFER_WINDOW = 5
"""How many recent finished transfers the C2 estimate is the median of."""

Activity = tuple[int, bool]
"""What a replicator says of its transfers at an instant: how many have begun, and whether one is in flight."""


@dataclass(frozen=True)
class StepTimes:
    """The step durations seen so far, replaced, never mutated. ``calm``: recent steps no transfer overlapped,
    newest last; ``transfers``: ``(summed seconds, steps)`` of each recent finished transfer; ``current``: the
    transfer whose steps are being summed (``(transfer, seconds, steps)``; finished when a step overlaps
    another transfer or none)."""

    calm: tuple[float, ...] = ()
    transfers: tuple[tuple[float, int], ...] = ()
    current: Optional[tuple[int, float, int]] = None


def overlapped(before: Optional[Activity], after: Optional[Activity]) -> Optional[int]:
    """The transfer a step overlapped, from the replicator's activity when the step began (``before``) and when
    it ended (``after``): the newest transfer that began during the step, else the one in flight when it began;
    ``None`` for a calm step (or when either reading is missing: no replicator)."""
    if before is None or after is None:
        return None
    if after[0] != before[0]:
        return after[0]
    return before[0] if before[1] else None


def record_step(times: StepTimes, seconds: float, transfer: Optional[int]) -> StepTimes:
    """The step times after a step that took ``seconds`` and overlapped ``transfer`` (``None``: calm)."""
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"seconds={seconds!r} must be a finite number of seconds >= 0")
    current = times.current
    if transfer is not None and current is not None and current[0] == transfer:
        return dataclasses.replace(times, current=(transfer, current[1] + seconds, current[2] + 1))
    done = times.transfers if current is None else (times.transfers + ((current[1], current[2]),))[-TRANSFER_WINDOW:]
    if transfer is None:
        return StepTimes(calm=(times.calm + (float(seconds),))[-STEP_WINDOW:], transfers=done)
    return StepTimes(calm=times.calm, transfers=done, current=(transfer, float(seconds), 1))


def transfer_cost(times: StepTimes) -> Optional[float]:
    """C2 in seconds: the median over recent finished transfers of their steps' extra time over the calm median,
    floored at 0; ``None`` until a calm step and a finished transfer were both seen."""
    if not times.calm or not times.transfers:
        return None
    calm = statistics.median(times.calm)
    return statistics.median(max(0.0, total - steps * calm) for total, steps in times.transfers)
