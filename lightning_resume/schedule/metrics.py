"""Checkpoint health metrics: the numbers a run logs at each save, as a flat dict.

Pure: takes the schedule state and the save's measurements, returns ``{"ckpt/...": float}`` ready
for ``LightningModule.log_dict`` / ``logger.log_metrics``. It must not read clocks, files or
Lightning; the callback passes ``now`` and the time of the newest durable checkpoint.
"""

from __future__ import annotations

from typing import Dict, Optional

from lightning_resume.schedule.policy import ScheduleState, cost_estimate, current_interval, expected_waste_now

PREFIX = "ckpt/"


def save_metrics(
    state: ScheduleState,
    now: float,
    blocked_s: Optional[float] = None,
    write_s: Optional[float] = None,
    nbytes: Optional[int] = None,
    newest_durable_time: Optional[float] = None,
) -> Dict[str, float]:
    """Metrics after a save (or after its async write became durable).

    Keys, each present only when known: ``ckpt/blocked_s`` (training blocked), ``ckpt/write_s``,
    ``ckpt/bytes``, ``ckpt/write_MBps`` (bytes / write_s / 1e6), ``ckpt/interval_s`` (current T*),
    ``ckpt/cost_s`` (C estimate), ``ckpt/mtbf_s`` (job M), ``ckpt/expected_waste`` (fraction of wall
    time, ``schedule.expected_waste`` at T*), ``ckpt/durable_age_s`` (``now`` minus the time of the
    newest durable checkpoint; same clock as ``now``), ``ckpt/saves``.
    """
    metrics: Dict[str, Optional[float]] = {
        "blocked_s": blocked_s,
        "write_s": write_s,
        "bytes": None if nbytes is None else float(nbytes),
        "write_MBps": nbytes / write_s / 1e6 if nbytes is not None and write_s else None,
        "interval_s": current_interval(state),
        "cost_s": cost_estimate(state),
        "mtbf_s": state.mtbf_s,
        "expected_waste": expected_waste_now(state),
        "durable_age_s": None if newest_durable_time is None else max(0.0, now - newest_durable_time),
        "saves": float(state.saves),
    }
    return {PREFIX + k: float(v) for k, v in metrics.items() if v is not None}
