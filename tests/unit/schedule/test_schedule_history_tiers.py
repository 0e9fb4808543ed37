"""The failure history records the tier each resume came from: a memory-tier resume after a crash is
a process failure (the machine survived), a disk resume after an unclean stop a node failure; old
files (no tier) still load, and files with tiers stay readable by the version-1 reader."""

import json

import pytest

from lightning_resume.schedule import history
from lightning_resume.schedule.config import ScheduleConfig
from lightning_resume.schedule.history import (
    EventKind,
    estimate_mtbf,
    estimate_node_mtbf,
    estimate_process_mtbf,
    history_path,
    load_history,
    record_clean_stop,
    record_start,
    save_history,
)
from lightning_resume.schedule.scheduler import SnapshotScheduler
from lightning_resume.schedule.state import Tier

HOUR = 3600.0

OLD_FILE = {  # written by lightning-resume before tiers were recorded (version 1, no "tier" key)
    "version": 1,
    "run_start": 0.0,
    "clean_stop_time": None,
    "events": [
        {
            "restart_time": 4600.0,
            "checkpoint_time": 4000.0,
            "lost_s": 600.0,
            "interval_s": 4600.0,
            "uptime_s": 4000.0,
            "kind": "failure",
        }
    ],
}


def test_memory_resume_after_a_crash_is_a_process_failure_and_a_disk_resume_a_node_failure(tmp_path):
    path = history_path(tmp_path)
    h = record_start(load_history(path), now=0.0, checkpoint_time=None)
    h = record_start(h, now=1000.0, checkpoint_time=990.0, tier=Tier.MEMORY)  # crash, memory survived
    h = record_start(h, now=5000.0, checkpoint_time=3000.0, tier=Tier.DURABLE)  # crash, node lost
    h = record_clean_stop(h, now=6000.0)
    h = record_start(h, now=7000.0, checkpoint_time=6000.0, tier=Tier.MEMORY)  # clean stop: no failure at all
    assert save_history(path, h)
    loaded = load_history(path)
    assert loaded == h
    assert [e.tier for e in loaded.events] == [Tier.MEMORY, Tier.DURABLE, Tier.MEMORY]
    assert [e.kind for e in loaded.events] == [EventKind.FAILURE, EventKind.FAILURE, EventKind.CLEAN_STOP]
    assert [e.restart_time for e in loaded.process_failures] == [1000.0]
    assert [e.restart_time for e in loaded.node_failures] == [5000.0]
    assert len(loaded.failures) == 2


def test_old_history_files_load_and_count_their_failures_as_node_failures(tmp_path):
    path = history_path(tmp_path)
    with open(path, "w") as f:
        json.dump(OLD_FILE, f)
    loaded = load_history(path)  # no HistoryWarning: pytest's filterwarnings=error would fail it
    assert loaded.events[0].tier is None and loaded.events[0].kind is EventKind.FAILURE
    assert loaded.node_failures == loaded.failures and loaded.process_failures == ()


def test_new_files_keep_the_version_1_layout_for_older_readers(tmp_path):
    path = history_path(tmp_path)
    h = record_start(record_start(history.FailureHistory(), 0.0, None), 100.0, 90.0, tier=Tier.MEMORY)
    save_history(path, h)
    raw = json.loads(open(path).read())
    assert raw["version"] == 1 and raw["events"][0]["tier"] == "memory"
    assert set(raw["events"][0]) - set(OLD_FILE["events"][0]) == {"tier"}  # only an added key


def test_estimates_count_each_class_of_failure():
    h = history.FailureHistory(run_start=0.0)
    for i in range(1, 9):  # eight process failures, one per hour of uptime
        h = record_start(h, now=i * HOUR, checkpoint_time=i * HOUR, tier=Tier.MEMORY)
    h = record_start(h, now=10 * HOUR, checkpoint_time=10 * HOUR, tier=Tier.DURABLE)  # one node failure
    now = 10 * HOUR
    exposure = 10 * HOUR
    assert estimate_process_mtbf(h, 2 * HOUR, 1.0, now) == pytest.approx((2 * HOUR + exposure) / 9)
    assert estimate_node_mtbf(h, 24 * HOUR, 1.0, now) == pytest.approx((24 * HOUR + exposure) / 2)
    assert estimate_mtbf(h, 2 * HOUR, 1.0, now) == pytest.approx((2 * HOUR + exposure) / 10)


def test_scheduler_records_the_resumed_tier_and_uses_observed_m1_and_m2(tmp_path):
    cfg = ScheduleConfig.from_user(
        mtbf="observed", mtbf_prior="24h", process_mtbf="observed", process_mtbf_prior="1h", min_interval=1
    )
    first = SnapshotScheduler(cfg)
    first.start(0, 1, str(tmp_path), None, None, True)
    for _ in range(3):  # three crashes resumed from the memory tier
        sched = SnapshotScheduler(cfg)
        sched.start(10, 1, str(tmp_path), None, checkpoint_wall_time=0.0, is_rank_zero=True, resumed_tier="memory")
    events = load_history(history_path(tmp_path)).events
    assert [e.tier for e in events] == [Tier.MEMORY] * 3 and len(
        load_history(history_path(tmp_path)).process_failures
    ) == 3
    assert sched.memory is not None and sched.state is not None
    # M1 from three process failures in ~no exposure: about the prior / 4; M2 untouched by them
    assert sched.memory.process_mtbf_s == pytest.approx(HOUR / 4, rel=0.01)
    assert sched.state.mtbf_s == pytest.approx(24 * HOUR, rel=0.01)
