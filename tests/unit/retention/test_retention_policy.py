"""Property and example tests of the pure retention policy (no Lightning, no files)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_resume.errors import ConfigurationError
from lightning_resume.retention.policy import ANCHOR, CheckpointRecord, RetentionPolicy, newest_verified_record


def rec(step, time=None, metric=None, **kw):
    return CheckpointRecord(f"/ck/step={step:09d}.ckpt", step, 0, float(step if time is None else time), metric, **kw)


metrics = st.one_of(st.none(), st.just(math.nan), st.floats(-10, 10, allow_nan=False))
policies = st.builds(
    RetentionPolicy,
    keep_last=st.one_of(st.none(), st.integers(1, 4)),
    keep_best=st.one_of(st.none(), st.integers(1, 3)),
    mode=st.sampled_from(["min", "max"]),
    anchor_every_n_steps=st.one_of(st.none(), st.integers(1, 30)),
    anchor_every=st.one_of(st.none(), st.floats(1.0, 50.0)),
)


@st.composite
def histories(draw):
    """Saves over several runs: each restart resumes at an earlier step (maybe) and keeps saving."""
    records, step, time = [], 0, 0.0
    for _run in range(draw(st.integers(1, 3))):
        step = max(0, step - draw(st.integers(0, 20)))
        for _ in range(draw(st.integers(0, 12))):
            step += draw(st.integers(1, 15))
            time += draw(st.floats(0.5, 20.0))
            path = f"/ck/step={step:09d}.ckpt"
            records = [r for r in records if r.path != path]  # same name: the file is rewritten
            records.append(
                CheckpointRecord(
                    path,
                    step,
                    0,
                    time,
                    draw(metrics),
                    frozenset({"rolling"}),
                    verified=draw(st.booleans() | st.just(True)),
                    in_flight=False,
                    owned=draw(st.just(True) | st.booleans()),
                )
            )
    if records and draw(st.booleans()):
        last = records[-1]
        records[-1] = CheckpointRecord(**{**last.__dict__, "in_flight": True, "verified": False})
    return records


def kept_paths(decisions):
    return {d.record.path for d in decisions if d.keep}


@settings(max_examples=300, deadline=None)
@given(policies, histories(), st.data())
def test_protected_and_anchors_always_kept(policy, history, data):
    resume = data.draw(st.sampled_from([None] + [r.path for r in history]))
    decisions = policy.decide(history, resume)
    kept = kept_paths(decisions)
    newest = newest_verified_record(history)
    if newest is not None:
        assert newest.path in kept
    if resume is not None:
        assert resume in kept
    assert {r.path for r in history if r.in_flight or not r.owned} <= kept
    assert {r.path for r in policy.anchors(history)} <= kept
    assert all(d.reasons for d in decisions)
    assert len(decisions) == len(history)


@settings(max_examples=300, deadline=None)
@given(policies, histories(), st.data())
def test_at_most_the_rules_plus_protected_remain(policy, history, data):
    if not policy.active:
        return
    resume = data.draw(st.sampled_from([None] + [r.path for r in history]))
    kept = kept_paths(policy.decide(history, resume))
    protected = {r.path for r in history if r.in_flight or not r.owned or not r.verified} | {resume} - {None}
    newest = newest_verified_record(history)
    protected |= {newest.path} if newest else set()
    bound = (policy.keep_last or 0) + (policy.keep_best or 0) + len(policy.anchors(history)) + len(protected)
    assert len(kept) <= bound


@settings(max_examples=200, deadline=None)
@given(policies, histories())
def test_a_file_that_does_not_verify_is_never_deleted(policy, history):
    """It may be damaged or of a format this version cannot read: a person decides, not the policy."""
    unverified = {r.path for r in history if not r.verified}
    assert unverified <= kept_paths(policy.decide(history))


@settings(max_examples=200, deadline=None)
@given(policies, histories(), st.randoms())
def test_decisions_are_deterministic_and_order_free(policy, history, rnd):
    shuffled = list(history)
    rnd.shuffle(shuffled)
    assert policy.decide(history) == policy.decide(shuffled)


@settings(max_examples=200, deadline=None)
@given(policies, histories(), histories())
def test_an_anchor_stays_an_anchor_as_history_grows(policy, first, later):
    """Apply the policy as the callback does (delete, tag anchors), then add later saves."""
    survivors = []
    anchors = {r.path for r in policy.anchors(first)}
    for d in policy.decide(first):
        if d.keep:
            tags = d.record.tags | ({ANCHOR} if d.record.path in anchors else set())
            survivors.append(CheckpointRecord(**{**d.record.__dict__, "tags": tags}))
    offset_t = max((r.time for r in first), default=0.0)
    grown = survivors + [
        CheckpointRecord(**{**r.__dict__, "path": r.path + ".later", "time": r.time + offset_t}) for r in later
    ]
    assert anchors <= kept_paths(policy.decide(grown))
    assert anchors <= {r.path for r in policy.anchors(grown)}


def test_keep_last_keep_best_and_step_anchors_example():
    history = [rec(s, metric=m) for s, m in [(10, 5.0), (20, 1.0), (30, 3.0), (40, 2.0), (50, 4.0), (60, 6.0)]]
    policy = RetentionPolicy(keep_last=2, keep_best=1, anchor_every_n_steps=25)
    decisions = {d.record.step: d for d in policy.decide(history)}
    # anchors: first save in [25, 50) is 30, in [50, 75) is 50; best is 20; last two are 50, 60
    assert {s for s, d in decisions.items() if d.keep} == {20, 30, 50, 60}
    assert decisions[10].reasons == ("delete: older than the 2 most recent; not among the 1 best; not an anchor",)
    assert "best: among the 1 best (min metric)" in decisions[20].reasons
    assert "protected: newest verified checkpoint" in decisions[60].reasons


def test_nan_and_none_are_never_best_and_mode_max():
    history = [rec(1, metric=math.nan), rec(2, metric=None), rec(3, metric=0.5), rec(4, metric=0.9), rec(5, metric=0.1)]
    kept = {d.record.step for d in RetentionPolicy(keep_best=1, mode="max").decide(history) if d.keep}
    assert kept == {4, 5}  # 4: best (max); 5: newest verified


def test_corrupt_newest_is_not_the_newest_verified():
    history = [rec(1), rec(2), rec(3, verified=False)]
    decisions = {d.record.step: d for d in RetentionPolicy(keep_last=1).decide(history)}
    assert decisions[2].keep and "protected: newest verified checkpoint" in decisions[2].reasons
    assert not decisions[1].keep  # the rolling rule counts only verified files
    assert decisions[3].keep and decisions[3].reasons == (
        "protected: does not verify (kept for inspection; delete it by hand)",
    )


def test_time_anchors_use_a_fixed_grid():
    history = [rec(s, time=t) for s, t in [(1, 95.0), (2, 105.0), (3, 150.0), (4, 199.0), (5, 230.0)]]
    anchors = RetentionPolicy(anchor_every=100.0).anchors(history)
    assert [r.step for r in anchors] == [1, 2, 5]  # first in [0,100), [100,200), [200,300)
    grown = history + [rec(6, time=260.0), rec(7, time=310.0)]
    assert [r.step for r in RetentionPolicy(anchor_every=100.0).anchors(grown)] == [1, 2, 5, 7]


def test_inactive_policy_keeps_everything():
    assert all(d.keep for d in RetentionPolicy().decide([rec(1), rec(2, verified=False)]))


def test_configuration_errors_are_collected():
    with pytest.raises(ConfigurationError) as info:
        RetentionPolicy(keep_last=0, keep_best=0, mode="up", anchor_every_n_steps=0, anchor_every=-1.0)
    assert len(info.value.problems) == 5
    assert "keep_last=0 would delete the checkpoint being written; use >= 1" in info.value.problems[0]


def test_record_state_round_trip():
    record = rec(7, metric=0.25, tags=frozenset({"rolling", ANCHOR}))
    assert CheckpointRecord.from_state(record.to_state()) == record


def test_one_anchor_per_interval_even_when_an_earlier_step_arrives_later():
    policy = RetentionPolicy(anchor_every_n_steps=10)
    tagged = rec(15, time=1.0, tags=frozenset({ANCHOR}))
    # a restart from step 8 later saves step 12, inside the same interval [10, 20)
    later = rec(12, time=2.0)
    assert [r.step for r in policy.anchors([tagged, later])] == [15]
    assert [r.step for r in policy.anchors([rec(15, time=1.0), later])] == [12]  # untagged: smallest step wins
