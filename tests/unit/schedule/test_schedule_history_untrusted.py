"""A failure history is untrusted input (it comes from inside the checkpoint resumed from): out-of-range
values, deep nesting or too many events give a ``HistoryWarning`` naming the source and the problem, and
the schedule starts anyway, with a finite, positive interval."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_resume.errors import HistoryWarning
from lightning_resume.schedule import history
from lightning_resume.schedule import state as machine
from lightning_resume.schedule.config import ScheduleConfig
from lightning_resume.schedule.scheduler import CHECKPOINT_SOURCE, SnapshotScheduler

HOUR = 3600.0
NOW = 1.7e9  # the wall clock of the resumed process
CONFIG = ScheduleConfig.from_user(
    mtbf="observed", mtbf_prior="24h", process_mtbf="observed", process_mtbf_prior="1h", min_interval=1
)

EVENT = {
    "restart_time": 4600.0,
    "checkpoint_time": 4000.0,
    "lost_s": 600.0,
    "interval_s": 4600.0,
    "uptime_s": 4000.0,
    "kind": "failure",
    "tier": None,
}


def _history(*events: dict, **top: Any) -> dict:
    return {"version": 1, "run_start": 0.0, "clean_stop_time": None, "events": list(events), **top}


def _nested(depth: int) -> list:
    deep: list = []
    for _ in range(depth):
        deep = [deep]
    return deep


def _resume(data: Any, saved_at: Optional[float] = NOW - 10.0) -> SnapshotScheduler:
    """A process resuming at ``NOW`` with ``data`` as the failure history the checkpoint carries."""
    sched = SnapshotScheduler(CONFIG, clock=lambda: 100.0, wall_clock=lambda: NOW)
    sched.start(10, 1, {"history": data}, saved_at, resumed_tier="durable")
    return sched


def _assert_usable(sched: SnapshotScheduler) -> None:
    """The schedule decides, and every interval it computes is a finite number of seconds > 0."""
    assert sched.state is not None and sched.memory is not None
    for m in (sched.state.mtbf_s, sched.memory.process_mtbf_s):
        assert m is not None and math.isfinite(m) and m > 0
    interval, t1 = machine.current_interval(sched.state), machine.memory_interval(sched.state, sched.memory)
    assert interval is not None and math.isfinite(interval) and interval > 0
    assert t1 is not None and math.isfinite(t1) and t1 > 0
    sched.decide(11, 0, lambda values: values, True)


def _assert_fresh(sched: SnapshotScheduler) -> None:
    """The bad history counted for nothing: only this start's failure, no uptime, so M = prior / 2."""
    assert sched.history is not None and len(sched.history.events) == 1
    assert sched.state is not None and sched.state.mtbf_s == pytest.approx(24 * HOUR / 2)


BAD_VALUES = {
    "negative uptime": (_history(dict(EVENT, uptime_s=-1e300)), r"uptime_s=-1e\+300 is not a duration"),
    "overflowing uptimes": (
        _history(dict(EVENT, uptime_s=1e308), dict(EVENT, uptime_s=1e308)),
        r"uptime_s=1e\+308 is not a duration in \[0, 3.15576e\+09\] s \(100 years\)",
    ),
    "infinite uptime": (_history(dict(EVENT, uptime_s=math.inf)), "uptime_s=inf is not a duration"),
    "NaN loss": (_history(dict(EVENT, lost_s=math.nan)), "lost_s=nan is not a duration"),
    "negative timestamp": (
        _history(dict(EVENT, restart_time=-5.0)),
        r"restart_time=-5.0 is not a wall time \(a finite number of seconds >= 0\)",
    ),
    "huge integer": (_history(run_start=10**400), "run_start=an integer of 1329 bits"),
    "string duration": (_history(dict(EVENT, interval_s="1h")), "interval_s=a str is not a duration"),
    "boolean time": (_history(clean_stop_time=True), "clean_stop_time=a bool"),
    "event not an object": (_history([1, 2]), "event 0 is a list, not an object"),
    "events not a list": (_history(events={"0": EVENT}), "events is a dict, not a list"),
    "unknown kind": (_history(dict(EVENT, kind=["failure"])), r"event 0: kind=a list is not one of \['failure'"),
    "missing key": (_history({k: v for k, v in EVENT.items() if k != "uptime_s"}), "event 0: no uptime_s"),
    "deeply nested value": (_history(run_start=_nested(100_000)), "run_start=a list is not a wall time"),
}


def _warns_unreadable(problem: str) -> Any:
    """Expect the one ``HistoryWarning`` that names the source and the problem."""
    return pytest.warns(
        HistoryWarning, match=rf"^{re.escape(CHECKPOINT_SOURCE)}: unreadable resume history \(.*{problem}"
    )


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_an_out_of_range_or_malformed_history_warns_and_the_schedule_starts_from_the_prior(case: str) -> None:
    data, problem = BAD_VALUES[case]
    with _warns_unreadable(problem):
        sched = _resume(data)
    _assert_usable(sched)
    _assert_fresh(sched)


def test_deep_nesting_warns_instead_of_a_recursion_error() -> None:
    with _warns_unreadable("not a version-1 resume history"):
        sched = _resume(_nested(100_000))
    _assert_usable(sched)
    _assert_fresh(sched)


def test_only_the_newest_events_are_kept() -> None:
    n = history.MAX_EVENTS + 3
    restarts = [NOW - 10.0 - (n + 1 - i) * HOUR for i in range(1, n + 1)]  # a failure every hour of uptime
    events = [dict(EVENT, restart_time=t, checkpoint_time=t, uptime_s=HOUR) for t in restarts]
    match = (
        rf"^{re.escape(CHECKPOINT_SOURCE)}: the resume history holds {n} events, more than the 10000 kept; the oldest 3"
    )
    with pytest.warns(HistoryWarning, match=match):
        sched = _resume(_history(*events))
    _assert_usable(sched)
    kept = sched.history
    assert kept is not None and len(kept.events) == history.MAX_EVENTS  # this start pushed one more out
    assert [e.restart_time for e in kept.events[:1] + kept.events[-2:]] == [restarts[4], restarts[-1], NOW]
    # the estimate reads the kept lives only: 10000 failures (this start's too) after an hour each
    assert kept.failures == kept.events
    expected = (24 * HOUR + history.MAX_EVENTS * HOUR) / (1 + history.MAX_EVENTS)
    assert sched.state is not None and sched.state.mtbf_s == pytest.approx(expected)


@pytest.mark.parametrize("saved_at", [math.inf, math.nan, -1.0, "yesterday"])
def test_a_checkpoint_time_that_is_no_wall_time_warns_and_credits_no_uptime(saved_at: Any) -> None:
    past = _history(EVENT)  # the previous process started at 4600
    with pytest.warns(HistoryWarning, match="saved_at is not a wall time"):
        sched = _resume(past, saved_at=saved_at)
    _assert_usable(sched)
    assert sched.history is not None and sched.history.events[-1].uptime_s == 0.0
    assert sched.history.events[-1].checkpoint_time == EVENT["restart_time"]


# The pure estimate, for any records at all (as if a history bypassed the reader)

ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True)


@settings(max_examples=200, deadline=None)
@given(
    uptimes=st.lists(ANY_FLOAT, max_size=20),
    restart=ANY_FLOAT,
    now=st.floats(0.0, 1e12),
    prior=st.floats(1e-6, 1e300),
    weight=st.floats(1e-6, 1e300),
)
def test_the_estimate_and_the_intervals_stay_finite_and_positive_for_any_records(uptimes, restart, now, prior, weight):
    event = history.ResumeEvent(restart, restart, 0.0, 0.0, 0.0, history.EventKind.FAILURE)
    past = history.FailureHistory(run_start=0.0, events=tuple(dataclasses.replace(event, uptime_s=u) for u in uptimes))
    estimates = [f(past, prior, weight, now) for f in (history.estimate_node_mtbf, history.estimate_process_mtbf)]
    assert all(history.MIN_MTBF_S <= m <= history.MAX_DURATION_S for m in estimates)
    assert history.MIN_MTBF_S <= history.estimate_mtbf(past, prior, weight, now) <= history.MAX_DURATION_S
    state, memory = machine.start(CONFIG, 0.0, 0, mtbf_s=estimates[0], process_mtbf_s=estimates[1])
    assert memory is not None
    for t in (machine.current_interval(state), machine.memory_interval(state, memory)):
        assert t is not None and math.isfinite(t) and t > 0


@settings(max_examples=200, deadline=None)
@given(now=st.floats(0.0, 1e300), checkpoint_time=st.floats(0.0, 1e300), life=st.floats(0.0, 1e300))
def test_recorded_durations_stay_within_the_bounds_the_reader_accepts(now, checkpoint_time, life):
    past = history.FailureHistory(run_start=life)
    recorded = history.record_start(past, now, checkpoint_time)
    assert history.history_from_json(_through_json(recorded)) == recorded


def _through_json(h: history.FailureHistory) -> Any:
    return json.loads(json.dumps(history.history_to_json(h)))


@pytest.mark.parametrize(
    "bad",
    [
        {"costs": [-1.0]},
        {"costs": [float("inf")]},
        {"costs": "0.5"},
        {"memory_costs": [float("nan")]},
        {"last_write_s": -3.0},
        {"last_write_s": 1e308},
        {"saves": -1},
        {"memory_snapshots": "many"},
    ],
    ids=lambda bad: next(iter(bad)) + "=" + repr(next(iter(bad.values()))),
)
def test_an_invalid_schedule_state_in_the_checkpoint_warns_and_is_measured_again(bad: dict) -> None:
    """The rest of the scheduler state the checkpoint carries is untrusted too (before: a negative or inf
    cost made the interval formulas raise ValueError at start)."""
    sched = SnapshotScheduler(CONFIG, clock=lambda: 100.0, wall_clock=lambda: NOW)
    key = next(iter(bad))
    with pytest.warns(HistoryWarning, match=f"schedule state is invalid, measured again: {key}"):
        sched.start(10, 1, {"costs": [0.5], **bad}, NOW - 10.0, resumed_tier="durable")
    _assert_usable(sched)
    assert sched.state is not None and sched.state.saves >= 0 and sched.state.last_write_s is None
