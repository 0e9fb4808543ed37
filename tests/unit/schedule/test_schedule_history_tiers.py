"""The failure history records the tier each resume came from: a memory-tier resume after a crash is
a process failure (the machine survived), a disk resume after an unclean stop a node failure."""

import json

import pytest

from lightning_resume.schedule import history
from lightning_resume.schedule.config import ScheduleConfig
from lightning_resume.schedule.scheduler import SnapshotScheduler
from lightning_resume.schedule.state import Tier

HOUR = 3600.0


def test_memory_resume_after_a_crash_is_a_process_failure_and_a_disk_resume_a_node_failure():
    h = history.record_start(history.FailureHistory(), now=0.0, checkpoint_time=None)
    h = history.record_start(h, now=1000.0, checkpoint_time=990.0, tier=Tier.MEMORY)  # crash, memory survived
    h = history.record_start(h, now=5000.0, checkpoint_time=3000.0, tier=Tier.DURABLE)  # crash, node lost
    h = history.record_clean_stop(h, now=6000.0)
    h = history.record_start(h, now=7000.0, checkpoint_time=6000.0, tier=Tier.MEMORY)  # clean stop: no failure at all
    raw = json.loads(json.dumps(history.history_to_json(h)))  # as the checkpoint carries it
    assert [e["tier"] for e in raw["events"]] == ["memory", "durable", "memory"]
    loaded = history.read_history(raw, "the checkpoint")
    assert loaded == h
    assert [e.tier for e in loaded.events] == [Tier.MEMORY, Tier.DURABLE, Tier.MEMORY]
    assert [e.kind for e in loaded.events] == [
        history.EventKind.FAILURE,
        history.EventKind.FAILURE,
        history.EventKind.CLEAN_STOP,
    ]
    assert [e.restart_time for e in loaded.process_failures] == [1000.0]
    assert [e.restart_time for e in loaded.node_failures] == [5000.0]
    assert len(loaded.failures) == 2


def test_estimates_count_each_class_of_failure():
    h = history.FailureHistory(run_start=0.0)
    for i in range(1, 9):  # eight process failures, one per hour of uptime
        h = history.record_start(h, now=i * HOUR, checkpoint_time=i * HOUR, tier=Tier.MEMORY)
    h = history.record_start(h, now=10 * HOUR, checkpoint_time=10 * HOUR, tier=Tier.DURABLE)  # one node failure
    now = 10 * HOUR
    exposure = 10 * HOUR
    assert history.estimate_process_mtbf(h, 2 * HOUR, 1.0, now) == pytest.approx((2 * HOUR + exposure) / 9)
    assert history.estimate_node_mtbf(h, 24 * HOUR, 1.0, now) == pytest.approx((24 * HOUR + exposure) / 2)
    assert history.estimate_mtbf(h, 2 * HOUR, 1.0, now) == pytest.approx((2 * HOUR + exposure) / 10)


def test_scheduler_records_the_resumed_tier_and_uses_observed_m1_and_m2():
    cfg = ScheduleConfig.from_user(
        mtbf="observed", mtbf_prior="24h", process_mtbf="observed", process_mtbf_prior="1h", min_interval=1
    )
    sched = SnapshotScheduler(cfg, wall_clock=lambda: 1000.0)
    sched.start(0, 1, None, None)
    for restart in (2000.0, 3000.0, 4000.0):  # three crashes, each resumed from a memory snapshot 10 s old
        saved = sched.state_dict()  # what the snapshot resumed from carries, the history included
        sched = SnapshotScheduler(cfg, wall_clock=lambda: restart)
        sched.start(10, 1, saved, restart - 10.0, resumed_tier="memory")
    past = sched.history
    assert past is not None
    assert [e.tier for e in past.events] == [Tier.MEMORY] * 3 and len(past.process_failures) == 3
    assert [e.restart_time for e in past.events] == [2000.0, 3000.0, 4000.0]  # on the injected wall clock
    assert sched.memory is not None and sched.state is not None
    # three lives of 990 s each up to their snapshot: M1 = (prior + exposure) / (1 + 3); M2 sees no node failure
    assert sched.memory.process_mtbf_s == pytest.approx((HOUR + 3 * 990.0) / 4)
    assert sched.state.mtbf_s == pytest.approx(24 * HOUR + 3 * 990.0)
