"""The two-level schedule: the closed-form plan against brute force, its k = 1 limit, and the
memory/durable sequence ``SnapshotScheduler.decide`` produces on a fake clock."""

import math
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_resume.errors import ConfigurationError
from lightning_resume.schedule.config import ScheduleConfig
from lightning_resume.schedule.formulas import (
    TwoLevelPlan,
    first_order_waste,
    single_level_waste,
    two_level_plan,
    two_level_t1,
    two_level_waste,
    young_interval,
)
from lightning_resume.schedule.scheduler import SnapshotScheduler
from lightning_resume.schedule.state import (
    SaveReason,
    Tier,
    decide,
    durable_every,
    memory_interval,
    record_durable_snapshot,
    record_memory_snapshot,
    record_save,
    record_write_done,
    start,
)

costs = st.floats(min_value=1e-3, max_value=600.0)
mtbfs = st.floats(min_value=600.0, max_value=30 * 86400.0)


def brute_force(c1, c2, m1, m2, ks, grid=400):
    """min W over the given k and T1 on a log grid: no closed form used."""
    best = (math.inf, None, None)
    for k in ks:
        for i in range(grid):
            t1 = 1e-2 * (1e7 / 1e-2) ** (i / (grid - 1))  # 0.01 s .. 1e7 s
            w = c1 / t1 + c2 / (k * t1) + t1 / (2 * m1) + k * t1 / (2 * m2)
            if w < best[0]:
                best = (w, t1, k)
    return best


@settings(max_examples=25, deadline=None)
@given(c1=costs, c2=costs, m1=mtbfs, m2=mtbfs)
def test_closed_form_matches_brute_force_minimisation(c1, c2, m1, m2):
    plan = two_level_plan(c1, c2, m1, m2)
    assert plan.waste == pytest.approx(two_level_waste(plan.t1, plan.k, c1, c2, m1, m2))
    # no integer k does better at its own optimal T1 (the closed form's candidates are the best)
    exact = min(two_level_waste(two_level_t1(k, c1, c2, m1, m2), k, c1, c2, m1, m2) for k in range(1, 2000))
    assert plan.waste <= exact * (1 + 1e-12)
    ks = set(range(1, 30)) | set(range(max(1, plan.k - 30), plan.k + 30))
    w, _, k = brute_force(c1, c2, m1, m2, sorted(ks), grid=300)
    assert plan.waste <= w * (1 + 1e-12)
    assert w <= plan.waste * 1.01  # the grid's best is within its resolution of the plan
    assert plan.t2 == plan.k * plan.t1


def test_realistic_plan_halves_the_single_level_waste():
    # C1 = 0.2 s (memcpy to /dev/shm), C2 = 20 s (synchronous save), M1 = 1 h, M2 = 24 h
    plan = two_level_plan(0.2, 20.0, 3600.0, 86400.0)
    assert plan.k == round(math.sqrt(20.0 * 86400.0 / (0.2 * 3600.0))) or plan.k in (48, 49)
    assert single_level_waste(20.0, 3600.0, 86400.0) / plan.waste > 2.0
    assert isinstance(plan, TwoLevelPlan) and 0 < plan.t1 < plan.t2


@given(c1=costs, c2=costs, m1=mtbfs, m2=mtbfs, t=st.floats(min_value=1.0, max_value=1e6))
def test_k_equal_one_is_single_level_with_both_costs_and_both_rates(c1, c2, m1, m2, t):
    m = 1.0 / (1.0 / m1 + 1.0 / m2)
    assert two_level_waste(t, 1, c1, c2, m1, m2) == pytest.approx(first_order_waste(t, c1 + c2, m))
    assert two_level_t1(1, c1, c2, m1, m2) == pytest.approx(young_interval(c1 + c2, m))


def test_k_is_one_when_memory_is_no_cheaper_or_process_failures_rare():
    assert two_level_plan(10.0, 10.0, 86400.0, 3600.0).k == 1
    assert two_level_plan(0.0, 0.0, 3600.0, 86400.0) == TwoLevelPlan(t1=0.0, k=1, waste=0.0)
    assert two_level_plan(0.0, 5.0, 3600.0, 86400.0).k > 1000  # a free memory tier: durable rarely


@pytest.mark.parametrize(
    "args",
    [(-1.0, 1.0, 1.0, 1.0), (1.0, math.nan, 1.0, 1.0), (1.0, 1.0, 0.0, 1.0), (1.0, 1.0, 1.0, math.inf)],
)
def test_bad_plan_input_is_a_value_error(args):
    with pytest.raises(ValueError, match="must be"):
        two_level_plan(*args)


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def test_from_user_accepts_durations_for_the_process_mtbf():
    for value in ("1h", 3600, 3600.0, timedelta(hours=1)):
        cfg = ScheduleConfig.from_user(mtbf="24h", process_mtbf=value, memory_every_n_train_steps_max=50)
        assert cfg.process_mtbf_s == 3600.0 and cfg.mtbf_s == 86400.0 and cfg.memory_every_n_train_steps_max == 50
        assert cfg.takes_memory_snapshots
    assert not ScheduleConfig.from_user(mtbf="24h").takes_memory_snapshots
    cfg = ScheduleConfig.from_user(mtbf="24h", process_mtbf="observed", process_mtbf_prior="6h", num_nodes=2)
    assert cfg.process_mtbf_mode.value == "observed" and cfg.job_process_mtbf_s == 3 * 3600.0


def test_from_user_collects_every_memory_tier_problem():
    with pytest.raises(ConfigurationError) as err:
        ScheduleConfig.from_user(mtbf="24h", process_mtbf="soon", memory_every_n_train_steps_max=0)
    text = str(err.value)
    assert "memory_tier.process_mtbf='soon'" in text and "memory_tier.every_n_train_steps_max=0" in text
    with pytest.raises(ConfigurationError, match="process_mtbf=-5.0s must be > 0"):
        ScheduleConfig.from_user(process_mtbf=-5)
    with pytest.raises(ConfigurationError, match="process_mtbf_prior"):
        ScheduleConfig.from_user(process_mtbf="observed")


def test_a_run_without_the_memory_tier_keeps_the_durable_options_on_a_single_level_schedule():
    cfg = ScheduleConfig.from_user(mtbf="observed", mtbf_prior="24h", process_mtbf="observed", process_mtbf_prior="1h")
    single = cfg.single_level()
    assert not single.takes_memory_snapshots and single.process_mtbf_mode.value == "configured"
    assert single.with_nodes(1) == ScheduleConfig.from_user(mtbf="observed", mtbf_prior="24h")
    assert start(single, 0.0, 0)[1] is None


# --------------------------------------------------------------------------------------------
# SnapshotScheduler.decide on a fake clock
# --------------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def identity(values):
    return values


def run(config, steps, step_s=1.0, c1=0.5, c2=10.0, restored=None):
    """Drive ``SnapshotScheduler.decide`` like the callback does; return [(step, tier, reason, time)]."""
    clock = Clock()
    sched = SnapshotScheduler(config, clock)
    sched.start(0, 1, restored, None)
    out = []
    for step in range(1, steps + 1):
        clock.now += step_s
        tier, preempt, reason = sched.decide(step, 0, identity, True)
        assert preempt == 0 and sched.next_check_step > step
        if tier is Tier.MEMORY:
            clock.now += c1
            metrics = sched.record_memory(step, c1, 1000)
            assert metrics["ckpt/memory_blocked_s"] == c1 and "ckpt/memory_cost_s" in metrics
        elif tier is Tier.DURABLE:
            clock.now += c2
            sched.record(step, c2, 1000)
        if tier is not Tier.NONE:
            out.append((step, tier, reason, clock.now))
    return sched, out


def test_memory_snapshots_every_t1_and_every_kth_is_durable():
    cfg = ScheduleConfig(mtbf_s=86400.0, process_mtbf_s=3600.0, min_interval_s=1.0, max_interval_s=1e6)
    restored = {"costs": [10.0], "memory_costs": [0.5]}  # measured in an earlier life: no early measuring saves
    sched, out = run(cfg, 6000, restored=restored)
    plan = two_level_plan(0.5, 10.0, 3600.0, 86400.0)
    assert plan.k == 22 and 55 < plan.t1 < 65
    tiers = [t for _, t, _, _ in out]
    durable_at = [i for i, t in enumerate(tiers) if t is Tier.DURABLE]
    assert durable_at and all(i % plan.k == plan.k - 1 for i in durable_at)  # every k-th snapshot is durable
    assert all(r == SaveReason.EVERY_KTH.value for _, t, r, _ in out if t is Tier.DURABLE)
    for (_, _, _, t0), (_, tier, _, t1) in zip(out, out[1:]):
        blocked = 10.0 if tier is Tier.DURABLE else 0.5
        assert t1 - blocked - t0 == pytest.approx(plan.t1, abs=1.0)  # one T1 of training between snapshots
    assert sched.state_dict()["memory_snapshots"] == len(tiers) - len(durable_at)


def test_durable_save_counts_as_the_steps_memory_snapshot():
    cfg = ScheduleConfig(mtbf_s=86400.0, process_mtbf_s=3600.0, min_interval_s=1.0, max_interval_s=1e6)
    clock = Clock()
    sched = SnapshotScheduler(cfg, clock)
    sched.start(0, 1, {"costs": [10.0], "memory_costs": [0.5]}, None)
    clock.now = 100.0
    sched.record(100, 10.0, None)
    assert sched.memory is not None and sched.memory.since_durable == 0
    sched.record_memory(100, 0.4, None)  # the mechanism refreshing memory from the durable save's staging
    assert sched.memory.since_durable == 0 and sched.memory.snapshots == 0 and sched.memory.costs[-1] == 0.4


def test_step_caps_pace_both_tiers_without_mtbfs():
    cfg = ScheduleConfig(every_n_train_steps_max=10, memory_every_n_train_steps_max=3)
    _, out = run(cfg, 25)
    assert [(s, t) for s, t, _, _ in out] == [
        (3, Tier.MEMORY), (6, Tier.MEMORY), (9, Tier.MEMORY), (10, Tier.DURABLE),
        (13, Tier.MEMORY), (16, Tier.MEMORY), (19, Tier.MEMORY), (20, Tier.DURABLE),
        (23, Tier.MEMORY),
    ]  # fmt: skip
    assert {r for _, t, r, _ in out if t is Tier.MEMORY} == {SaveReason.MEMORY_STEP_CAP.value}


def test_without_a_memory_tier_every_snapshot_is_durable_on_the_single_level_schedule():
    cfg = ScheduleConfig(mtbf_s=3600.0, min_interval_s=5.0, initial_cost_s=100.0)
    sched, out = run(cfg, 500, c2=2.0)
    assert not sched.takes_memory_snapshots and sched.memory is None
    assert {t for _, t, _, _ in out} == {Tier.DURABLE}
    assert out[0][:3] == (5, Tier.DURABLE, SaveReason.FIRST_MEASUREMENT.value)  # after min_interval, to measure C
    assert {r for _, _, r, _ in out[1:]} == {SaveReason.INTERVAL.value}
    for (_, _, _, t0), (_, _, _, t1) in zip(out, out[1:]):  # then one T* = sqrt(2 C M) of training apart
        assert t1 - 2.0 - t0 == pytest.approx(young_interval(2.0, 3600.0), abs=1.0)


def test_first_memory_snapshot_measures_c1_early_and_the_first_durable_measures_c2():
    cfg = ScheduleConfig(mtbf_s=86400.0, process_mtbf_s=3600.0, min_interval_s=5.0, max_interval_s=1e6)
    _, out = run(cfg, 200)
    assert out[0][:3] == (5, Tier.DURABLE, SaveReason.FIRST_MEASUREMENT.value)
    assert out[1][1:3] == (Tier.MEMORY, SaveReason.MEMORY_FIRST_MEASUREMENT.value)
    assert out[2][1:3] == (Tier.MEMORY, SaveReason.MEMORY_INTERVAL.value)


def test_max_interval_clamps_both_tiers():
    cfg = ScheduleConfig(mtbf_s=86400.0, process_mtbf_s=3600.0, min_interval_s=1.0, max_interval_s=300.0)
    _, out = run(cfg, 3000, restored={"costs": [10.0], "memory_costs": [0.5]})
    durable_times = [t for _, tier, _, t in out if tier is Tier.DURABLE]
    gaps = [b - a for a, b in zip(durable_times, durable_times[1:])]
    assert gaps and max(gaps) <= 300.0 + 10.0 + 5 * 0.5 + 2.0  # k lowered so k * T1 fits max_interval


def test_ranks_agree_on_the_highest_tier():
    cfg = ScheduleConfig(every_n_train_steps_max=4, memory_every_n_train_steps_max=2)
    clock = Clock()
    follower = SnapshotScheduler(cfg, clock)
    follower.start(0, 1, None, None)
    seen = []

    def agree(values):  # rank 0 says MEMORY at step 2, DURABLE at step 4; its next check is step + 1
        seen.append(list(values))
        return [max(values[0], {2: 1, 4: 2}.get(step, 0)), step + 1, max(values[2], 0), values[3]]

    tiers = []
    for step in range(1, 5):
        clock.now += 1.0
        tiers.append(follower.decide(step, 1 if step == 3 else 0, agree, False)[:2])
    assert tiers == [(Tier.NONE, 0), (Tier.MEMORY, 0), (Tier.NONE, 1), (Tier.DURABLE, 0)]
    assert all(v[0] == 0 for v in seen)  # a follower proposes nothing


def test_a_clamped_t1_gets_the_best_k_for_that_t1():
    # measured C1 = 0.34 s, C2 = 3.4 s: the plan's T1 is ~50 s, below min_interval = 60 s
    cfg = ScheduleConfig(mtbf_s=86400.0, process_mtbf_s=3600.0, min_interval_s=60.0)
    restored = {"costs": [3.4], "memory_costs": [0.34]}
    state, memory = start(cfg, 0.0, 0, restored=restored)
    assert memory is not None
    plan = two_level_plan(0.34, 3.4, 3600.0, 86400.0)
    assert plan.t1 < 60.0 and memory_interval(state, memory) == 60.0
    k = durable_every(state, memory)
    best = min(range(1, 200), key=lambda n: two_level_waste(60.0, n, 0.34, 3.4, 3600.0, 86400.0))
    assert k == best and k != plan.k


def drive_tiers(config, step_times, c1, c2, write_s, every_step):
    """Rank 0 alone, pure policy: async durable writes finish ``write_s`` after their save."""
    (state, memory), now = start(config, 0.0, 0), 0.0
    assert memory is not None
    next_check, write_end, out = 1, None, []
    for step, dt in enumerate(step_times, start=1):
        now += dt
        if write_end is not None and now >= write_end:
            state, write_end = record_write_done(state, now), None
        if not every_step and step < next_check:
            continue
        d = decide(state, memory, now, step)
        assert d.next_check_step > step
        next_check = d.next_check_step
        if d.tier is Tier.DURABLE:
            assert write_end is None, f"durable save at step {step} while a write is in flight"
            now += c2
            state, write_end = record_save(state, now, step, c2), now + write_s
            memory = record_durable_snapshot(memory, now, step)
        elif d.tier is Tier.MEMORY:
            now += c1
            memory = record_memory_snapshot(memory, now, step, c1)
        if d.tier is not Tier.NONE:
            out.append((step, d.tier))
    return out


@settings(max_examples=20, deadline=None)
@given(
    step_s=st.floats(min_value=0.05, max_value=3.0),
    m1=st.floats(min_value=300.0, max_value=7200.0),
    m2=st.floats(min_value=7200.0, max_value=86400.0),
    c1=st.floats(min_value=0.01, max_value=2.0),
    ratio=st.floats(min_value=1.0, max_value=100.0),
    write_s=st.floats(min_value=0.0, max_value=60.0),
    caps=st.tuples(st.none() | st.integers(50, 400), st.none() | st.integers(5, 60)),
)
def test_sparse_checks_snapshot_at_the_same_steps_as_checking_every_step(step_s, m1, m2, c1, ratio, write_s, caps):
    cfg = ScheduleConfig(
        mtbf_s=m2,
        process_mtbf_s=m1,
        min_interval_s=2.0,
        max_interval_s=3600.0,
        check_interval_s=30.0,
        every_n_train_steps_max=caps[0],
        memory_every_n_train_steps_max=caps[1],
    )
    steps = [step_s] * int(4000 / step_s)
    sparse = drive_tiers(cfg, steps, c1, c1 * ratio, write_s, every_step=False)
    dense = drive_tiers(cfg, steps, c1, c1 * ratio, write_s, every_step=True)
    assert sparse and {t for _, t in sparse} <= {Tier.MEMORY, Tier.DURABLE}
    # checks are planned from the mean step time: with constant steps they land on the same steps
    assert sparse == dense


def test_a_pessimistic_c1_guess_still_gets_measured():
    # with the 5 s guess, k = 1 (every snapshot durable); the first memory snapshot measures the real C1
    cfg = ScheduleConfig(mtbf_s=7200.0, process_mtbf_s=300.0, min_interval_s=2.0, check_interval_s=30.0)
    sched, out = run(cfg, 200, step_s=0.05 * 20, c1=0.01, c2=0.05)
    tiers = [t for _, t, _, _ in out]
    assert tiers[:2] == [Tier.DURABLE, Tier.MEMORY] and Tier.MEMORY in tiers[2:]
    assert sched.memory is not None and sched.memory.costs[0] == 0.01
