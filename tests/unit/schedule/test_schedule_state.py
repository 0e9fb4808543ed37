"""The schedule state machine, driven the way ExactResume drives it: rank 0 decides only at
``next_check_step``, reports saves, and async writes finish later."""

import math
from dataclasses import dataclass, field
from typing import List, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_resume.schedule.config import ScheduleConfig
from lightning_resume.schedule.formulas import young_interval
from lightning_resume.schedule.metrics import save_metrics
from lightning_resume.schedule.state import (
    SaveReason,
    ScheduleState,
    Tier,
    cost_estimate,
    current_interval,
    decide,
    record_save,
    record_write_done,
    start,
    state_dict,
)


def single_level_start(config: ScheduleConfig, now: float, step: int, **kwargs) -> ScheduleState:
    """The durable tier's state alone (these configs have no memory tier)."""
    state, memory = start(config, now, step, **kwargs)
    assert memory is None
    return state


@dataclass
class Trace:
    saves: List[tuple] = field(default_factory=list)  # (step, time, reason)
    checks: int = 0
    violations: List[str] = field(default_factory=list)
    intervals: List[Optional[float]] = field(default_factory=list)


def drive(config, step_times, blocked, write_s, async_write=True, every_step=False, mtbf_s=None):
    """Run a fake training loop; ``blocked``/``write_s`` are per-save cycles (repeated)."""
    now, state, trace = 0.0, single_level_start(config, 0.0, 0, mtbf_s=mtbf_s), Trace()
    next_check, write_end = 1, None
    for step, dt in enumerate(step_times, start=1):
        now += dt
        if write_end is not None and now >= write_end:  # rank 0 polls its writer locally, no collective
            state, write_end = record_write_done(state, now), None
        if not every_step and step < next_check:
            continue
        trace.checks += 1
        decision = decide(state, None, now, step)
        if decision.next_check_step <= step:
            trace.violations.append(f"next_check_step {decision.next_check_step} <= step {step}")
        next_check = decision.next_check_step
        if decision.tier is Tier.NONE:
            continue
        if write_end is not None:
            trace.violations.append(f"save at step {step} while a write is in flight")
        i = len(trace.saves)
        b, w = blocked[i % len(blocked)], write_s[i % len(write_s)]
        trace.saves.append((step, now, decision.reason))
        now += b
        state = record_save(state, now, step, b, None if async_write else w)
        write_end = now + w if async_write else None
        trace.intervals.append(current_interval(state))
    return state, trace


def test_first_save_is_early_then_the_interval_follows_the_measured_cost():
    cfg = ScheduleConfig(mtbf_s=3600.0, min_interval_s=5.0, max_interval_s=1e5, initial_cost_s=100.0)
    state, trace = drive(cfg, [1.0] * 400, blocked=[2.0], write_s=[0.5])
    first_step, first_time, reason = trace.saves[0]
    assert reason is SaveReason.FIRST_MEASUREMENT and first_time == 5.0  # not T*(C0) = sqrt(2*100*3600) = 849 s
    assert cost_estimate(state) == 2.0
    t_star = young_interval(2.0, 3600.0)  # 120 s
    gaps = [b[1] - a[1] - 2.0 for a, b in zip(trace.saves, trace.saves[1:])]
    assert all(g == pytest.approx(t_star, abs=1.0) for g in gaps) and len(gaps) >= 2
    assert all(r is SaveReason.INTERVAL for _, _, r in trace.saves[1:])


def test_sparse_checks_save_at_the_same_steps_as_checking_every_step():
    cfg = ScheduleConfig(mtbf_s=7200.0, min_interval_s=3.0, check_interval_s=20.0)
    steps = [0.05] * 20_000
    _, sparse = drive(cfg, steps, blocked=[0.4], write_s=[0.2])
    _, dense = drive(cfg, steps, blocked=[0.4], write_s=[0.2], every_step=True)
    assert [s for s, _, _ in sparse.saves] == pytest.approx([s for s, _, _ in dense.saves], abs=1)
    # 1000 s of training: about one check per 20 s plus a few around each save, not 20 000
    assert sparse.checks < 1000 / 20 + 4 * (len(sparse.saves) + 1)
    assert not sparse.violations


def test_async_write_time_floors_the_interval_and_no_save_overlaps_a_write():
    cfg = ScheduleConfig(mtbf_s=3600.0, min_interval_s=1.0, initial_cost_s=1.0, check_interval_s=100.0)
    _, trace = drive(cfg, [0.5] * 4000, blocked=[0.1], write_s=[60.0])  # T*(0.1 s) = 27 s < write 60 s
    assert not trace.violations
    gaps = [b[1] - a[1] for a, b in zip(trace.saves, trace.saves[1:])]
    assert min(gaps) >= 60.0 and len(gaps) >= 10
    # ... and the next save follows the write's end closely (checks aim at its expected end,
    # not at the 100 s check interval): 60 s write + 0.1 s blocked + at most 2 steps
    assert max(gaps[1:]) <= 60.1 + 1.0 + 1e-6
    assert all(iv >= 60.0 for iv in trace.intervals[1:])


def test_step_cap_and_mtbf_none():
    cfg = ScheduleConfig(mtbf_s=None, every_n_train_steps_max=50)
    _, trace = drive(cfg, [1.0] * 500, blocked=[0.1], write_s=[0.1], async_write=False)
    assert [s for s, _, _ in trace.saves] == list(range(50, 501, 50))
    assert all(r is SaveReason.STEP_CAP for _, _, r in trace.saves)
    off = single_level_start(ScheduleConfig(mtbf_s=None), 0.0, 0)
    decision = decide(off, None, 1e9, 10**6)
    assert decision.tier is Tier.NONE and decision.reason is SaveReason.OFF
    assert current_interval(off) is None and save_metrics(off, 1.0)["ckpt/cost_s"] == 60.0


def test_restored_state_skips_the_measuring_save_and_keeps_costs():
    cfg = ScheduleConfig(mtbf_s=3600.0, min_interval_s=5.0)
    state = record_save(single_level_start(cfg, 0.0, 0), 10.0, 10, blocked_s=3.0, write_s=1.0)
    resumed = single_level_start(cfg, 1e6, 10, restored=state_dict(state))
    assert resumed.costs == (3.0,) and resumed.anchor_time == 1e6 and resumed.saves == 1
    assert decide(resumed, None, 1e6 + 6.0, 16).tier is Tier.NONE  # 6 s > min_interval but < T*
    assert decide(resumed, None, 1e6 + young_interval(3.0, 3600.0), 100).reason is SaveReason.INTERVAL


def test_metrics_after_a_save():
    cfg = ScheduleConfig(mtbf_s=86400.0, num_nodes=4)
    state = record_save(single_level_start(cfg, 0.0, 0), 100.0, 100, blocked_s=2.0, write_s=4.0)
    m = save_metrics(state, 110.0, blocked_s=2.0, write_s=4.0, nbytes=400_000_000, newest_durable_time=104.0)
    assert m["ckpt/write_MBps"] == pytest.approx(100.0) and m["ckpt/bytes"] == 4e8
    assert m["ckpt/mtbf_s"] == 21600.0 and m["ckpt/cost_s"] == 2.0 and m["ckpt/durable_age_s"] == 6.0
    assert m["ckpt/interval_s"] == pytest.approx(young_interval(2.0, 21600.0))
    assert 0 < m["ckpt/expected_waste"] < 0.02 and all(k.startswith("ckpt/") for k in m)


configs = st.builds(
    ScheduleConfig,
    mtbf_s=st.one_of(st.none(), st.floats(10.0, 1e6)),
    min_interval_s=st.floats(0.0, 50.0),
    max_interval_s=st.floats(50.0, 5000.0),
    every_n_train_steps_max=st.one_of(st.none(), st.integers(1, 300)),
    initial_cost_s=st.floats(0.01, 100.0),
    formula=st.sampled_from(["young", "daly"]),
    check_interval_s=st.floats(0.5, 100.0),
)


@settings(max_examples=150, deadline=None)
@given(
    cfg=configs,
    step_times=st.lists(st.floats(0.01, 5.0), min_size=1, max_size=600),
    blocked=st.lists(st.floats(0.0, 20.0), min_size=1, max_size=5),
    write_s=st.lists(st.floats(0.0, 200.0), min_size=1, max_size=5),
    async_write=st.booleans(),
)
def test_schedule_invariants(cfg, step_times, blocked, write_s, async_write):
    state, trace = drive(cfg, step_times, blocked, write_s, async_write)
    assert not trace.violations  # never a save during a write; the next check is always ahead
    for iv in trace.intervals:
        if iv is not None:  # clamped, and floored only by a write longer than max_interval
            assert cfg.min_interval_s <= iv <= max(cfg.max_interval_s, max(write_s)) + 1e-9
    prev_end = 0.0
    for i, (step, t, reason) in enumerate(trace.saves):
        if reason in (SaveReason.INTERVAL, SaveReason.FIRST_MEASUREMENT):
            assert t - prev_end >= cfg.min_interval_s - 1e-9  # time-based saves respect min_interval
        prev_end = t + blocked[i % len(blocked)]
    if not async_write and cfg.every_n_train_steps_max:  # no write ever in flight: the cap is exact
        steps = [0] + [s for s, _, _ in trace.saves]
        assert all(b - a <= cfg.every_n_train_steps_max for a, b in zip(steps, steps[1:]))
        assert len(step_times) - steps[-1] < cfg.every_n_train_steps_max
    again, trace2 = drive(cfg, step_times, blocked, write_s, async_write)
    assert again == state and trace2.saves == trace.saves  # deterministic


def test_record_save_rejects_nonsense():
    state = single_level_start(ScheduleConfig(mtbf_s=100.0), 0.0, 0)
    with pytest.raises(ValueError, match="blocked_s"):
        record_save(state, 1.0, 1, blocked_s=-1.0)
    with pytest.raises(ValueError, match="write_s"):
        record_save(state, 1.0, 1, blocked_s=1.0, write_s=math.nan)
    assert record_write_done(state, 5.0) is state  # nothing in flight: nothing changes
