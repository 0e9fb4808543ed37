"""The failure history (carried in the checkpoints' schedule state) and the observed-MTBF estimate."""

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_resume.schedule.history import (
    EventKind,
    FailureHistory,
    HistoryWarning,
    estimate_mtbf,
    history_to_json,
    read_history,
    record_clean_stop,
    record_start,
)

HOUR = 3600.0
SOURCE = "the checkpoint"


def _stored(h: FailureHistory) -> Any:
    """``h`` as a checkpoint carries it: its JSON form, through a serializer."""
    return json.loads(json.dumps(history_to_json(h)))


def _loaded(stored: Any) -> FailureHistory:
    return read_history(stored, SOURCE)


def test_a_run_with_two_crashes_and_a_preemption():
    h = record_start(FailureHistory(), now=1000.0, checkpoint_time=None)  # fresh run
    # crash; the newest durable snapshot was taken at t=4000; restart at t=4600
    h = record_start(_loaded(_stored(h)), now=4600.0, checkpoint_time=4000.0)
    # preempted: a snapshot at 8000 then a clean stop, requeued at 9000
    stored = _stored(record_clean_stop(h, now=8001.0))
    h = record_start(_loaded(stored), now=9000.0, checkpoint_time=8000.0)
    # crash again, snapshot at 12000, restart at 12500
    h = record_start(_loaded(_stored(h)), now=12500.0, checkpoint_time=12000.0)

    raw = _stored(h)
    loaded = _loaded(raw)
    assert loaded == h
    kinds = [e.kind for e in loaded.events]
    assert kinds == [EventKind.FAILURE, EventKind.CLEAN_STOP, EventKind.FAILURE]
    first, clean, second = loaded.events
    assert (first.lost_s, first.interval_s, first.uptime_s) == (600.0, 3600.0, 3000.0)
    assert clean.lost_s == 1000.0 and clean.uptime_s == 8001.0 - 4600.0
    assert second.interval_s == 12500.0 - 4600.0 and second.uptime_s == 12000.0 - 9000.0
    assert raw["version"] == 1 and raw["events"][0]["kind"] == "failure"


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
    "stored",
    [
        "{not json",
        [],
        {"version": 99, "events": []},
        {"version": 1, "run_start": "x", "events": []},
        {"version": 1, "run_start": 0, "clean_stop_time": None, "events": [{"kind": "meteor"}]},
    ],
)
def test_corrupt_history_warns_and_starts_fresh(stored):
    with pytest.warns(HistoryWarning, match=f"{SOURCE}: unreadable resume history"):
        h = _loaded(stored)
    assert h == FailureHistory()
    # the next start still works, and the next checkpoint carries a good history
    h = record_start(h, now=50.0, checkpoint_time=40.0)
    assert _loaded(_stored(h)) == h
    assert h.run_start == 40.0 and h.events[0].uptime_s == 0.0


def test_fresh_run_discards_an_old_history():
    old = record_start(FailureHistory(run_start=0.0), now=10.0, checkpoint_time=5.0)
    assert record_start(old, now=100.0, checkpoint_time=None) == FailureHistory(run_start=100.0)
