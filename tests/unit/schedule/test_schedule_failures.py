"""The failure history file (resume_history.json) and the observed-MTBF estimate."""

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_resume.schedule.history import (
    EventKind,
    FailureHistory,
    HistoryWarning,
    estimate_mtbf,
    history_path,
    load_history,
    record_clean_stop,
    record_start,
    save_history,
)

HOUR = 3600.0


def test_a_run_with_two_crashes_and_a_preemption(tmp_path):
    path = history_path(tmp_path)
    h = record_start(load_history(path), now=1000.0, checkpoint_time=None)  # fresh run
    assert save_history(path, h)
    # crash; the newest durable snapshot was taken at t=4000; restart at t=4600
    h = record_start(load_history(path), now=4600.0, checkpoint_time=4000.0)
    save_history(path, h)
    # preempted: a snapshot at 8000 then a clean stop, requeued at 9000
    save_history(path, record_clean_stop(h, now=8001.0))
    h = record_start(load_history(path), now=9000.0, checkpoint_time=8000.0)
    save_history(path, h)
    # crash again, snapshot at 12000, restart at 12500
    h = record_start(load_history(path), now=12500.0, checkpoint_time=12000.0)
    save_history(path, h)

    loaded = load_history(path)
    assert loaded == h
    kinds = [e.kind for e in loaded.events]
    assert kinds == [EventKind.FAILURE, EventKind.CLEAN_STOP, EventKind.FAILURE]
    first, clean, second = loaded.events
    assert (first.lost_s, first.interval_s, first.uptime_s) == (600.0, 3600.0, 3000.0)
    assert clean.lost_s == 1000.0 and clean.uptime_s == 8001.0 - 4600.0
    assert second.interval_s == 12500.0 - 4600.0 and second.uptime_s == 12000.0 - 9000.0
    raw = json.loads(open(path).read())
    assert raw["version"] == 1 and raw["events"][0]["kind"] == "failure"
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]  # no temp file left behind


def test_estimate_blends_prior_and_observations():
    h = FailureHistory(run_start=0.0)
    # no failure yet: survival pushes M up from the prior
    assert estimate_mtbf(h, prior_mtbf_s=10 * HOUR, prior_weight=1.0, now=0.0) == 10 * HOUR
    assert estimate_mtbf(h, 10 * HOUR, 1.0, now=10 * HOUR) == 20 * HOUR
    # ten failures, one per hour of uptime: M tends to 1 h as evidence outweighs the prior
    for i in range(10):
        t = (i + 1) * HOUR
        h = record_start(h, now=t, checkpoint_time=t)
    m = estimate_mtbf(h, prior_mtbf_s=10 * HOUR, prior_weight=1.0, now=10 * HOUR)
    assert m == pytest.approx((10 * HOUR + 10 * HOUR) / 11)
    strong = estimate_mtbf(h, prior_mtbf_s=10 * HOUR, prior_weight=100.0, now=10 * HOUR)
    assert strong > 8 * HOUR  # a heavy prior barely moves
    with pytest.raises(ValueError, match="prior_mtbf_s"):
        estimate_mtbf(h, 0.0, 1.0, 0.0)


@settings(max_examples=100, deadline=None)
@given(gaps=st.lists(st.floats(1.0, 1e5), min_size=1, max_size=30), prior=st.floats(60.0, 1e6))
def test_more_failures_in_the_same_time_never_raise_the_estimate(gaps, prior):
    now, h_many = 0.0, FailureHistory(run_start=0.0)
    for g in gaps:
        now += g
        h_many = record_start(h_many, now=now, checkpoint_time=now)
    h_none = FailureHistory(run_start=0.0)
    assert estimate_mtbf(h_many, prior, 1.0, now) <= estimate_mtbf(h_none, prior, 1.0, now) + 1e-6


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"[]",
        b'{"version": 99, "events": []}',
        b'{"version": 1, "run_start": "x", "events": []}',
        b'{"version": 1, "run_start": 0, "clean_stop_time": null, "events": [{"kind": "meteor"}]}',
        b"\xff\xfe\x00",
    ],
)
def test_corrupt_history_warns_and_starts_fresh(tmp_path, content):
    path = history_path(tmp_path)
    with open(path, "wb") as f:
        f.write(content)
    with pytest.warns(HistoryWarning, match="resume_history.json: unreadable resume history"):
        h = load_history(path)
    assert h == FailureHistory()
    # the next start still works and overwrites the bad file
    h = record_start(h, now=50.0, checkpoint_time=40.0)
    assert save_history(path, h) and load_history(path) == h
    assert h.run_start == 40.0 and h.events[0].uptime_s == 0.0


def test_missing_file_is_a_fresh_history_and_a_write_error_only_warns(tmp_path):
    assert load_history(str(tmp_path / "nope.json")) == FailureHistory()
    (tmp_path / "a_file").write_text("not a directory")
    with pytest.warns(HistoryWarning, match="could not write"):
        assert not save_history(str(tmp_path / "a_file" / "resume_history.json"), FailureHistory(run_start=1.0))


def test_fresh_run_discards_an_old_history():
    old = record_start(FailureHistory(run_start=0.0), now=10.0, checkpoint_time=5.0)
    assert record_start(old, now=100.0, checkpoint_time=None) == FailureHistory(run_start=100.0)
