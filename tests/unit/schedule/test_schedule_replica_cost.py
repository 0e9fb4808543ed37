"""C2 measured from the run: the pure estimator (``schedule.replica_cost``) over step durations and the transfers
they overlapped, and its wiring: a replicator whose transfers are in flight over known windows of a fake clock,
driven through ``driver.at_step_boundary``, moves the three-level plan's C2 from the prior (3 % of D2) to the
measured extra step time per transfer, which ``ckpt/replica_cost_s`` reports."""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_resume.exact import driver
from lightning_resume.memory import replicate, transport
from lightning_resume.memory.replicate import TransferStats
from lightning_resume.memory.store import MemoryStore, memory_root
from lightning_resume.schedule import replica_cost
from lightning_resume.schedule.config import ScheduleConfig
from lightning_resume.schedule.metrics import memory_metrics
from lightning_resume.schedule.replica_cost import StepTimes, overlapped, record_step, transfer_cost
from lightning_resume.schedule.scheduler import SnapshotScheduler
from lightning_resume.schedule.state import REPLICA_STEP_OVERHEAD, levels


def _steps(samples: list[tuple[float, Optional[int]]]) -> StepTimes:
    times = StepTimes()
    for seconds, transfer in samples:
        times = record_step(times, seconds, transfer)
    return times


# The estimator (pure)


def test_the_extra_time_of_a_transfers_steps_over_calm_ones_is_its_cost() -> None:
    calm = [(1.0, None)] * 4
    # transfer 1 overlaps three steps of 1.5 s: 1.5 s more than three calm steps; it ends at the next calm step
    times = _steps(calm + [(1.5, 1), (1.5, 1), (1.5, 1)])
    assert transfer_cost(times) is None  # transfer 1 still in flight: nothing finished yet
    assert transfer_cost(record_step(times, 1.0, None)) == pytest.approx(1.5)
    # a transfer that is followed straight by the next one is finished by it
    assert transfer_cost(record_step(times, 1.2, 2)) == pytest.approx(1.5)


def test_nothing_is_measured_until_both_kinds_of_step_were_seen() -> None:
    assert transfer_cost(StepTimes()) is None
    assert transfer_cost(_steps([(1.0, None)] * 10)) is None  # calm only
    assert transfer_cost(_steps([(1.0, 1), (1.0, 2), (1.0, 3)])) is None  # transfers only, back to back


def test_faster_steps_during_a_transfer_cost_nothing() -> None:
    times = _steps([(1.0, None), (1.0, None), (0.9, 1), (0.9, 1), (1.0, None)])
    assert transfer_cost(times) == 0.0


def test_one_slow_step_or_one_slow_transfer_does_not_move_the_estimate() -> None:
    samples: list[tuple[float, Optional[int]]] = []
    for n in range(1, 6):
        samples += [(1.0, None)] * 9 + [(60.0 if n == 3 else 1.0, None)]  # one validation run among calm steps
        samples += [(1.1, n), (1.1, n)] if n != 4 else [(1.1, n), (30.0, n)]  # transfer 4: a slow step
    times = record_step(_steps(samples), 1.0, None)
    assert transfer_cost(times) == pytest.approx(0.2)


def test_windows_are_bounded_and_newest_win() -> None:
    times = _steps([(5.0, None)] * 100 + [(1.0, None)] * replica_cost.STEP_WINDOW)
    assert len(times.calm) == replica_cost.STEP_WINDOW and set(times.calm) == {1.0}
    for n in range(1, 20):
        times = record_step(record_step(times, 3.0 if n < 10 else 1.5, n), 1.0, None)
    assert len(times.transfers) == replica_cost.TRANSFER_WINDOW
    assert transfer_cost(times) == pytest.approx(0.5)


def test_a_bad_duration_is_refused() -> None:
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="seconds="):
            record_step(StepTimes(), bad, None)


def test_the_transfer_a_step_overlapped() -> None:
    assert overlapped((3, False), (3, False)) is None  # calm
    assert overlapped((3, True), (3, True)) == 3  # in flight throughout
    assert overlapped((3, True), (3, False)) == 3  # ended during the step
    assert overlapped((3, False), (4, True)) == 4  # began during the step
    assert overlapped((3, False), (4, False)) == 4  # began and ended within the step
    assert overlapped((3, True), (5, True)) == 5  # the newest one that began during the step
    assert overlapped(None, (1, True)) is None and overlapped((1, True), None) is None  # no replicator


@settings(max_examples=60, deadline=None)
@given(
    calm=st.floats(0.01, 10.0),
    extra=st.floats(0.0, 5.0),
    steps=st.integers(1, 8),
    transfers=st.integers(1, 12),
)
def test_a_constant_slowdown_is_measured_exactly(calm: float, extra: float, steps: int, transfers: int) -> None:
    samples: list[tuple[float, Optional[int]]] = []
    for n in range(1, transfers + 1):
        samples += [(calm, None)] * 3 + [(calm + extra / steps, n)] * steps
    times = record_step(_steps(samples), calm, None)
    assert transfer_cost(times) == pytest.approx(extra, rel=1e-9, abs=1e-9)


# The replicator says when a transfer is in flight


def test_the_replicator_reports_a_transfer_in_flight(tmp_path: Path, monkeypatch) -> None:
    sending, release = threading.Event(), threading.Event()

    def send_file(fd: Any, dst: int, group: Any, record: Any = (), **kw: Any) -> int:
        if fd is not None:
            sending.set()
            assert release.wait(60)
        return 10

    monkeypatch.setattr(transport, "send_file", send_file)
    monkeypatch.setattr(replicate, "_receive_ack", lambda holder, group: (replicate.STORED, 10, 0))
    store = MemoryStore(memory_root(str(tmp_path)), "0123456789abcdef", rank=0, world_size=2)
    replicator = replicate.Replicator(store, None, holders=[1], owners=[])
    assert replicator.activity() == (0, False)
    replicator.start()
    (tmp_path / "a").write_bytes(b"a")
    replicator.offer(os.open(tmp_path / "a", os.O_RDONLY), step=1, seq=1)
    assert sending.wait(60)
    assert replicator.activity() == (1, True)
    release.set()
    while replicator.sent < 1:
        threading.Event().wait(0.01)
    while replicator.activity()[1]:
        threading.Event().wait(0.01)
    assert replicator.activity() == (1, False)
    assert replicator.stop(timeout=60)


# The wiring: step boundaries -> the plan's C2


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class WindowedReplicator:
    """A replicator whose transfers are in flight over fixed windows of the fake clock."""

    def __init__(self, clock: Clock, windows: list[tuple[float, float]]) -> None:
        self.clock, self.windows = clock, windows
        self.enabled = True
        self.last_transfer: Optional[TransferStats] = None

    def activity(self) -> tuple[int, bool]:
        now = self.clock.now
        begun = sum(1 for start, _ in self.windows if start <= now)
        return begun, any(start <= now < end for start, end in self.windows)


def _trainer(step: int) -> Any:
    strategy = SimpleNamespace(root_device=None)
    return SimpleNamespace(global_step=step, is_global_zero=True, loggers=[], world_size=1, strategy=strategy)


def _three_level(clock: Clock) -> SnapshotScheduler:
    # node losses as common as process losses: the plan replicates; a huge min_interval: no snapshot is ever due,
    # so the steps are timed with nothing of ours in them
    cfg = ScheduleConfig(mtbf_s=3600.0, process_mtbf_s=3600.0, min_interval_s=1e4, num_nodes=2, replicas=None)
    sched = SnapshotScheduler(cfg, clock)
    sched.start(0, 2, {"costs": [20.0], "memory_costs": [0.5], "replica_costs": [10.0]}, None, replicas=1)
    return sched


def test_the_plans_c2_moves_from_the_prior_to_the_measured_cost() -> None:
    clock = Clock()
    sched = _three_level(clock)
    # transfers of 4 s every 20 s; a step takes 1 s calm and 1.25 s while a transfer is in flight
    windows = [(20.0 * n + 0.5, 20.0 * n + 4.5) for n in range(1, 8)]
    memory = SimpleNamespace(replicator=WindowedReplicator(clock, windows), replicas=1)
    assert sched.state is not None and sched.memory is not None
    prior = levels(sched.state, sched.memory)
    assert prior is not None and prior.c2 == pytest.approx(REPLICA_STEP_OVERHEAD * 10.0)
    assert memory_metrics(sched.state, sched.memory)["ckpt/replica_cost_s"] == pytest.approx(prior.c2)
    step = 0
    while clock.now < 20.0 * 8:
        _, in_flight = memory.replicator.activity()
        clock.now += 1.25 if in_flight else 1.0
        step += 1
        assert not driver.at_step_boundary(sched, None, _trainer(step), memory=memory)  # type: ignore[arg-type]
        if step == 20:  # calm steps seen, no transfer finished yet: still the prior
            assert levels(sched.state, sched.memory).c2 == pytest.approx(prior.c2)  # type: ignore[union-attr]
    measured = levels(sched.state, sched.memory)
    assert measured is not None
    # every transfer overlaps steps whose extra time sums to 0.25 s per step; its steps are found by the windows
    costs = [total - n * 1.0 for total, n in sched.memory.step_times.transfers]
    assert costs and all(c == pytest.approx(0.25 * round(c / 0.25)) and c >= 0.75 for c in costs)
    assert measured.c2 == pytest.approx(sorted(costs)[len(costs) // 2]) and measured.c2 != pytest.approx(prior.c2)
    assert memory_metrics(sched.state, sched.memory)["ckpt/replica_cost_s"] == pytest.approx(measured.c2)


def test_time_spent_in_our_hook_is_not_a_slow_step() -> None:
    """The step is the time from the end of one hook to the start of the next: what the hook itself blocks (its
    snapshots; here a notice check that takes 7 s) is C1 or C3, not a step."""
    clock = Clock()
    sched = _three_level(clock)
    memory = SimpleNamespace(replicator=WindowedReplicator(clock, []), replicas=1)

    def slow_check(wall: float, cost: Optional[float]) -> int:
        clock.now += 7.0
        return 0

    notices = SimpleNamespace(level=slow_check)
    for step in range(1, 6):
        clock.now += 1.0
        driver.at_step_boundary(sched, None, _trainer(step), memory=memory, notices=notices)  # type: ignore[arg-type]
    assert sched.memory is not None and sched.memory.step_times.calm == (1.0,) * 4
    clock.now += 500.0  # the fit ends; a second fit of the same trainer starts its schedule again
    sched.start(5, 2, None, None, replicas=1)
    clock.now += 1.0
    driver.at_step_boundary(sched, None, _trainer(6), memory=memory)  # type: ignore[arg-type]
    assert sched.memory is not None and sched.memory.step_times == StepTimes()  # its first step is not timed


def test_without_replicas_no_step_is_timed() -> None:
    clock = Clock()
    cfg = ScheduleConfig(mtbf_s=3600.0, process_mtbf_s=3600.0, min_interval_s=1e4, num_nodes=2, replicas=0)
    sched = SnapshotScheduler(cfg, clock)
    sched.start(0, 2, None, None, replicas=0)
    for step in range(1, 5):
        clock.now += 1.0
        driver.at_step_boundary(sched, None, _trainer(step), memory=None)
    assert sched.memory is not None and sched.memory.step_times == StepTimes()
