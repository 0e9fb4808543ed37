"""The three-level schedule (memory, replicas on peer nodes, durable): the plan against brute force, its
limits (replicas useless -> the two-level plan; free replicas -> two-level with node losses sent to memory;
no node losses -> no replicas), the scheduler's "replicate" decision and the failure history's node and
whole-job losses."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_resume.errors import ConfigurationError
from lightning_resume.schedule import history
from lightning_resume.schedule.config import ScheduleConfig
from lightning_resume.schedule.formulas import (
    Levels,
    ThreeLevelPlan,
    three_level_k,
    three_level_plan,
    three_level_t1,
    three_level_waste,
    two_level_plan,
    two_level_waste,
)
from lightning_resume.schedule.metrics import memory_metrics
from lightning_resume.schedule.scheduler import SnapshotScheduler
from lightning_resume.schedule.state import (
    REPLICA_STEP_OVERHEAD,
    Tier,
    current_plan,
    decide,
    durable_every,
    memory_interval,
    record_replica_transfer,
    replicate_now,
    start,
    state_dict,
)

HOUR, DAY = 3600.0, 86400.0
costs = st.floats(min_value=1e-3, max_value=300.0)
mtbfs = st.floats(min_value=600.0, max_value=60 * DAY)

# Llama 3 405B, 54 days, 419 unexpected interruptions (Llama 3 paper, table 5), job-wide: 63 software
# (bug, NCCL watchdog, dependency: the node survives), 356 hardware and host (a node lost), none whole-job
LLAMA3 = dict(m1=54 * 24 * HOUR / 63, m2=54 * 24 * HOUR / 356, m3=54 * DAY)


def merged(a: float, b: float) -> float:
    return 1.0 / (1.0 / a + 1.0 / b)


@settings(max_examples=20, deadline=None)
@given(c1=costs, c3=costs, d2=st.floats(min_value=0.0, max_value=120.0), m1=mtbfs, m2=mtbfs, m3=mtbfs)
def test_plan_beats_every_interval_and_k_brute_force(c1, c3, d2, m1, m2, m3):
    lv = Levels(c1=c1, c2=REPLICA_STEP_OVERHEAD * d2, d2=d2, c3=c3, m1=m1, m2=m2, m3=m3)
    plan = three_level_plan(lv)
    if plan.replicate:
        assert plan.waste == pytest.approx(three_level_waste(plan.t1, plan.k, lv))
        assert plan.t1 >= d2
    else:
        assert plan == ThreeLevelPlan(**vars(two_level_plan(*lv.without_replicas())), replicate=False)
    two = two_level_plan(*lv.without_replicas())
    assert plan.waste <= two.waste  # replicas are used only when they pay
    ks = sorted(set(range(1, 40)) | set(range(max(1, plan.k - 40), plan.k + 40)))
    grid = [1e-2 * (1e7 / 1e-2) ** (i / 299) for i in range(300)]
    best = min(three_level_waste(t, k, lv) for k in ks for t in grid if t >= d2)
    assert plan.waste <= best * (1 + 1e-9)


@given(c1=costs, c3=costs, m1=mtbfs, m2=mtbfs, m3=mtbfs, t1=st.floats(min_value=1.0, max_value=1e5))
def test_a_replica_that_never_lands_in_time_is_the_two_level_model(c1, c3, m1, m2, m3, t1):
    # D2 >= T1: every node loss finds the replica in flight and goes back to disk, as without replicas
    lv = Levels(c1=c1, c2=0.0, d2=2 * t1, c3=c3, m1=m1, m2=m2, m3=m3)
    for k in (1, 3, 40):
        assert three_level_waste(t1, k, lv) == pytest.approx(two_level_waste(t1, k, c1, c3, m1, merged(m2, m3)))


@given(c1=costs, c3=costs, m1=mtbfs, m2=mtbfs, m3=mtbfs)
def test_free_replicas_send_node_losses_to_memory(c1, c3, m1, m2, m3):
    # C2 = D2 = 0: a node loss costs what a process loss costs; the plan is the two-level one for M1' = M1 || M2
    lv = Levels(c1=c1, c2=0.0, d2=0.0, c3=c3, m1=m1, m2=m2, m3=m3)
    for t, k in ((10.0, 1), (100.0, 7), (5000.0, 300)):
        assert three_level_waste(t, k, lv) == pytest.approx(two_level_waste(t, k, c1, c3, merged(m1, m2), m3))
    plan, two = three_level_plan(lv), two_level_plan(c1, c3, merged(m1, m2), m3)
    assert plan.waste == pytest.approx(two.waste, rel=1e-12)  # the same optimum (k may differ on an exact tie)
    assert plan.replicate or plan.k == 1  # k = 1: every snapshot durable, replicas change nothing


def test_without_node_losses_replicas_are_off_and_the_plan_is_two_level():
    lv = Levels(c1=0.5, c2=0.03, d2=1.0, c3=20.0, m1=HOUR, m2=1e15, m3=30 * DAY)
    plan = three_level_plan(lv)
    assert not plan.replicate
    two = two_level_plan(*lv.without_replicas())
    assert (plan.t1, plan.k, plan.waste) == (two.t1, two.k, two.waste)


def test_the_llama3_mix_wastes_far_less_with_replicas():
    lv = Levels(c1=1.0, c2=REPLICA_STEP_OVERHEAD * 10.0, d2=10.0, c3=60.0, **LLAMA3)
    plan, two = three_level_plan(lv), two_level_plan(*lv.without_replicas())
    assert plan.replicate and two.waste / plan.waste > 2.0
    assert plan.k > two.k  # durable saves much rarer: only whole-job losses need them


@settings(max_examples=30, deadline=None)
@given(c1=costs, c3=costs, d2=st.floats(min_value=0.0, max_value=60.0), t1=st.floats(min_value=1.0, max_value=1e4))
def test_k_for_a_clamped_t1_is_the_best_integer(c1, c3, d2, t1):
    lv = Levels(c1=c1, c2=0.0, d2=d2, c3=c3, **LLAMA3)
    k = three_level_k(t1, lv)
    assert three_level_waste(t1, k, lv) <= min(three_level_waste(t1, n, lv) for n in range(1, 3000)) * (1 + 1e-12)


def test_t1_is_never_below_the_transfer_time():
    lv = Levels(c1=0.01, c2=0.0, d2=300.0, c3=1.0, m1=HOUR, m2=HOUR, m3=DAY)
    assert three_level_t1(1, lv) == 300.0


@pytest.mark.parametrize("field", ["c1", "c2", "d2", "c3", "m1", "m2", "m3"])
def test_bad_levels_are_a_value_error(field):
    values = dict(c1=1.0, c2=0.0, d2=1.0, c3=1.0, m1=1.0, m2=1.0, m3=1.0)
    values[field] = math.nan
    with pytest.raises(ValueError, match=f"{field}=nan"):
        Levels(**values)


# --------------------------------------------------------------------------------------------
# Configuration and the state machine
# --------------------------------------------------------------------------------------------


def three_level_config(**kw):
    base = dict(mtbf_s=30 * DAY, process_mtbf_s=HOUR, num_nodes=4, replicas=1, min_interval_s=1.0)
    return ScheduleConfig(**{**base, **kw})


def test_replicas_resolve_as_the_memory_tier_does():
    assert ScheduleConfig(process_mtbf_s=HOUR, replicas=None, num_nodes=2).replicates
    assert not ScheduleConfig(process_mtbf_s=HOUR, replicas=None, num_nodes=1).replicates
    assert not ScheduleConfig(process_mtbf_s=HOUR, replicas=0, num_nodes=4).replicates
    assert not ScheduleConfig(replicas=1, num_nodes=4).replicates  # no memory tier, nothing to replicate
    assert not three_level_config().single_level().replicates
    with pytest.raises(ConfigurationError, match=r"memory_tier.replicas=-1 must be an integer >= 0"):
        ScheduleConfig(replicas=-1)


def test_without_replicas_the_plan_is_exactly_the_two_level_one():
    restored = {"costs": [20.0], "memory_costs": [0.5], "replica_costs": [3.0]}
    state, memory = start(three_level_config(replicas=0), 0.0, 0, restored=restored)
    assert memory is not None and memory.node_mtbf_s is None
    assert current_plan(state, memory) == two_level_plan(0.5, 20.0, HOUR / 4, 30 * DAY / 4)
    assert not replicate_now(state, memory) and not decide(state, memory, 100.0, 10).replicate


def test_with_replicas_the_plan_is_three_level_and_snapshots_are_replicated():
    cfg = three_level_config()
    restored = {"costs": [20.0], "memory_costs": [0.5], "replica_costs": [3.0]}
    state, memory = start(cfg, 0.0, 0, restored=restored)
    assert memory is not None and memory.replica_costs == (3.0,)
    lv = Levels(c1=0.5, c2=REPLICA_STEP_OVERHEAD * 3.0, d2=3.0, c3=20.0, m1=HOUR / 4, m2=30 * DAY / 4, m3=30 * DAY)
    plan = current_plan(state, memory)
    assert plan == three_level_plan(lv) and isinstance(plan, ThreeLevelPlan) and plan.replicate
    assert memory_interval(state, memory) == pytest.approx(plan.t1) and durable_every(state, memory) == plan.k
    decision = decide(state, memory, plan.t1 + 1.0, 10)
    assert decision.tier is Tier.MEMORY and decision.replicate
    assert state_dict(state, memory)["replica_costs"] == [3.0]
    metrics = memory_metrics(state, memory, 0.5, 100)
    assert metrics["ckpt/replica_transfer_s"] == 3.0 and metrics["ckpt/replicate"] == 1.0
    assert metrics["ckpt/node_mtbf_s"] == 30 * DAY / 4 and metrics["ckpt/job_loss_mtbf_s"] == 30 * DAY
    assert metrics["ckpt/expected_waste"] == pytest.approx(three_level_waste(plan.t1, plan.k, lv))


def test_replicas_that_do_not_pay_are_not_sent_once_measured():
    # no node losses to speak of (M2 = 1e9 days): a replica only costs; but the first is sent, to measure D2
    cfg = three_level_config(mtbf_s=1e9 * DAY, num_nodes=1, replicas=1)
    state, memory = start(cfg, 0.0, 0, restored={"costs": [20.0], "memory_costs": [0.5]})
    assert memory is not None and replicate_now(state, memory)
    memory = record_replica_transfer(memory, 2.0)
    assert not replicate_now(state, memory)
    assert current_plan(state, memory) == ThreeLevelPlan(
        **vars(two_level_plan(0.5, 20.0, HOUR, merged(1e9 * DAY, 30 * DAY)))
    )


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_scheduler_agrees_on_rank_zeros_replicate_and_measures_d2():
    clock = Clock()
    leader = SnapshotScheduler(three_level_config(), clock)
    leader.start(0, 4, {"costs": [20.0], "memory_costs": [0.5]}, None)
    sent = []

    def agree(values):
        sent.append(list(values))
        return values

    tiers = []
    for step in range(1, 400):
        clock.now += 1.0
        tier, _, _ = leader.decide(step, 0, agree, True)
        if tier is Tier.MEMORY:
            tiers.append(leader.replicate)
            leader.record_memory(step, 0.5, 100)
            leader.record_replica(4.0)
    assert tiers and all(tiers) and len(sent[0]) == 4
    assert leader.memory is not None and leader.memory.replica_costs[-1] == 4.0
    follower = SnapshotScheduler(three_level_config(), clock)
    follower.start(0, 4, None, None)
    follower.decide(1, 0, lambda values: [1, 2, 0, 1], False)
    assert follower.replicate  # rank 0's answer, as agreed
    follower.decide(1, 0, lambda values: [1, 2, 0, 1], False)  # before its next check: no snapshot, no replica
    assert not follower.replicate


# --------------------------------------------------------------------------------------------
# The failure history: node losses and whole-job losses
# --------------------------------------------------------------------------------------------


def test_a_replica_resume_is_a_node_loss_and_a_durable_one_a_job_loss():
    h = history.record_start(history.FailureHistory(), now=0.0, checkpoint_time=None)
    h = history.record_start(h, now=1000.0, checkpoint_time=990.0, tier=Tier.MEMORY)
    h = history.record_start(h, now=2000.0, checkpoint_time=1990.0, tier=Tier.REPLICA)
    h = history.record_start(h, now=5000.0, checkpoint_time=3000.0, tier=Tier.DURABLE)
    h = history.record_start(h, now=6000.0, checkpoint_time=5900.0, tier=None)
    loaded = history.read_history(history.history_to_json(h), "the checkpoint")
    assert loaded == h and [e.tier for e in loaded.events] == [Tier.MEMORY, Tier.REPLICA, Tier.DURABLE, None]
    assert [e.restart_time for e in loaded.node_losses] == [2000.0]
    assert [e.restart_time for e in loaded.job_losses] == [5000.0, 6000.0]
    # without replicas every non-memory failure stays a node failure, as before
    assert [e.restart_time for e in loaded.node_failures] == [2000.0, 5000.0, 6000.0]
    exposure = history.exposure_s(loaded, 6000.0)
    assert history.estimate_node_loss_mtbf(loaded, DAY, 1.0, 6000.0) == pytest.approx((DAY + exposure) / 2)
    assert history.estimate_job_loss_mtbf(loaded, DAY, 1.0, 6000.0) == pytest.approx((DAY + exposure) / 3)


def test_scheduler_observes_node_and_job_losses_from_the_resumed_tiers():
    cfg = ScheduleConfig.from_user(
        mtbf="observed", mtbf_prior="30d", process_mtbf="observed", process_mtbf_prior="1h", num_nodes=2, replicas=1
    )
    sched = SnapshotScheduler(cfg, wall_clock=lambda: 1000.0)
    sched.start(0, 2, None, None)
    for restart, tier in ((2000.0, "replica"), (3000.0, "replica"), (4000.0, "durable")):
        saved = sched.state_dict()
        sched = SnapshotScheduler(cfg, wall_clock=lambda: restart)
        sched.start(10, 2, saved, restart - 10.0, resumed_tier=tier)
    memory = sched.memory
    assert memory is not None and sched.history is not None
    exposure = 3 * 990.0
    assert memory.node_mtbf_s == pytest.approx((15 * DAY + exposure) / 3)  # prior per node / 2 nodes, 2 losses
    assert memory.job_loss_mtbf_s == pytest.approx((30 * DAY + exposure) / 2)  # the job-wide prior, 1 loss
    assert memory.process_mtbf_s == pytest.approx(HOUR / 2 + exposure)  # no process failure
