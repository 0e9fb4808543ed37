"""Checkpoint health metrics: the numbers a run logs at each save, as a flat dict.

Pure: takes the schedule state and the save's measurements, returns ``{"ckpt/...": float}`` ready
for ``LightningModule.log_dict`` / ``logger.log_metrics``. It must not read clocks, files or
Lightning; the callback passes ``now`` and the time of the newest durable checkpoint.
"""

from __future__ import annotations

from typing import Dict, Optional

from lightning_resume.schedule.state import (
    MemoryState,
    ScheduleState,
    cost_estimate,
    current_interval,
    durable_every,
    expected_waste_now,
    memory_cost_estimate,
    memory_interval,
    replica_cost_estimate,
    replica_step_cost_estimate,
    replicate_now,
    two_level_waste_now,
)

PREFIX = "ckpt/"


def save_metrics(
    state: ScheduleState,
    now: float,
    blocked_s: Optional[float] = None,
    write_s: Optional[float] = None,
    nbytes: Optional[int] = None,
    newest_durable_time: Optional[float] = None,
    memory: Optional[MemoryState] = None,
) -> Dict[str, float]:
    """Metrics after a save (or after its async write became durable).

    Keys, each present only when known: ``ckpt/blocked_s`` (training blocked), ``ckpt/write_s``,
    ``ckpt/bytes``, ``ckpt/write_MBps`` (bytes / write_s / 1e6), ``ckpt/interval_s`` (current T*),
    ``ckpt/cost_s`` (C estimate), ``ckpt/mtbf_s`` (job M), ``ckpt/expected_waste`` (fraction of wall
    time, ``schedule.expected_waste`` at T*), ``ckpt/durable_age_s`` (``now`` minus the time of the
    newest durable checkpoint; same clock as ``now``), ``ckpt/saves``.

    With a two-level plan (``memory`` given, both MTBFs known) ``ckpt/interval_s`` is the durable
    interval as applied (k * T1) and ``ckpt/expected_waste`` the two-level first-order waste.
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
    if memory is not None and durable_every(state, memory) is not None:
        t1, k = memory_interval(state, memory), durable_every(state, memory)
        metrics["interval_s"] = None if t1 is None or k is None else t1 * k
        metrics["expected_waste"] = two_level_waste_now(state, memory)
    return {PREFIX + k: float(v) for k, v in metrics.items() if v is not None}


def memory_metrics(
    state: ScheduleState,
    memory: MemoryState,
    blocked_s: Optional[float] = None,
    nbytes: Optional[int] = None,
) -> Dict[str, float]:
    """Metrics after a memory-tier snapshot, named like the durable ones under ``ckpt/memory_``.

    Keys, each present only when known: ``ckpt/memory_blocked_s`` (training blocked, C1 sample),
    ``ckpt/memory_bytes``, ``ckpt/memory_copy_MBps``, ``ckpt/memory_interval_s`` (T1 as applied),
    ``ckpt/memory_cost_s`` (C1 estimate), ``ckpt/process_mtbf_s`` (job M1), ``ckpt/durable_every_k``,
    ``ckpt/memory_snapshots``, ``ckpt/expected_waste`` (two-level, first order). With replicas (three
    levels): ``ckpt/replica_transfer_s`` (D2 estimate), ``ckpt/replica_cost_s`` (C2: the training time a
    transfer costs, measured from the step times, else the prior 3 % of D2), ``ckpt/node_mtbf_s`` and ``ckpt/job_loss_mtbf_s``
    (job M2, M3), ``ckpt/replicate`` (1 when the plan sends snapshots to the peers), and the waste is the
    three-level one when it does.
    """
    k = durable_every(state, memory)
    metrics: Dict[str, Optional[float]] = {
        "memory_blocked_s": blocked_s,
        "memory_bytes": None if nbytes is None else float(nbytes),
        "memory_copy_MBps": nbytes / blocked_s / 1e6 if nbytes is not None and blocked_s else None,
        "memory_interval_s": memory_interval(state, memory),
        "memory_cost_s": memory_cost_estimate(state, memory),
        "process_mtbf_s": memory.process_mtbf_s,
        "durable_every_k": None if k is None else float(k),
        "memory_snapshots": float(memory.snapshots),
        "expected_waste": two_level_waste_now(state, memory),
    }
    if state.config.replicates:
        metrics["replica_transfer_s"] = replica_cost_estimate(state, memory)
        metrics["replica_cost_s"] = replica_step_cost_estimate(state, memory)
        metrics["node_mtbf_s"] = memory.node_mtbf_s
        metrics["job_loss_mtbf_s"] = memory.job_loss_mtbf_s
        metrics["replicate"] = float(replicate_now(state, memory))
    return {PREFIX + k: float(v) for k, v in metrics.items() if v is not None}
