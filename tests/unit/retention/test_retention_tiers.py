"""The pure per-tier policy of a mirrored run (no Lightning, no files): the local tier never drops what the
mirror lacks, each tier counts its own rules, sync anchors, and the backoff of a failing upload."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_resume.errors import ConfigurationError
from lightning_resume.retention.policy import ANCHOR, CheckpointRecord, RetentionPolicy
from lightning_resume.retention.tiers import NOT_ON_MIRROR, AnchorUpload, TieredPolicy, UploadRetry


def local(step: int, **kw) -> CheckpointRecord:
    return CheckpointRecord(f"/nvme/ck/step={step:09d}.ckpt", step, seq=step, **kw)


def remote(step: int, **kw) -> CheckpointRecord:
    return CheckpointRecord(f"s3://b/run/step={step:09d}.ckpt", step, seq=step, **kw)


def name(record: CheckpointRecord) -> str:
    return record.path.rsplit("/", 1)[-1]


def kept(decisions) -> list[int]:
    return [d.record.step for d in decisions if d.keep]


TIERS = TieredPolicy(RetentionPolicy(keep_last=3, anchor_every_n_steps=10), local_keep_last=1)


def test_each_tier_counts_its_own_rules() -> None:
    steps = [5, 10, 15, 20, 25, 30]
    on_mirror = {name(local(s)) for s in steps}
    assert kept(TIERS.decide_local([local(s) for s in steps], on_mirror)) == [30]  # anchors are the mirror's
    assert kept(TIERS.decide_mirror([remote(s) for s in steps])) == [10, 20, 25, 30]  # last 3 + anchors 10, 20


def test_a_local_copy_the_mirror_lacks_is_kept_whatever_the_rules_say() -> None:
    records = [local(s) for s in (5, 10, 15, 20)]
    decisions = TIERS.decide_local(records, on_mirror={name(local(5))})
    assert kept(decisions) == [10, 15, 20]
    assert [d.reasons for d in decisions if d.record.step in (10, 15)] == [(NOT_ON_MIRROR,), (NOT_ON_MIRROR,)]


def test_without_local_keep_last_the_local_tier_follows_the_rules() -> None:
    same = TieredPolicy(RetentionPolicy(keep_last=2, anchor_every_n_steps=10))
    records = [local(s) for s in (5, 10, 15, 20, 25)]
    assert kept(same.decide_local(records, {name(r) for r in records})) == [10, 20, 25]
    assert [r.step for r in same.local_anchors(records)] == [10, 20]
    assert TIERS.local_anchors([local(10, tags=frozenset({ANCHOR}))]) == []  # with local_keep_last: none locally


def test_sync_anchors_wait_for_the_upload_of_anchors_only() -> None:
    mirrored = [remote(5), remote(8)]
    assert TIERS.upload_first(mirrored, remote(10, verified=False, in_flight=True), AnchorUpload.SYNC)
    assert not TIERS.upload_first(mirrored, remote(9, verified=False, in_flight=True), AnchorUpload.SYNC)
    assert not TIERS.upload_first(mirrored, remote(10, verified=False, in_flight=True), AnchorUpload.ASYNC)
    assert not TIERS.upload_first([*mirrored, remote(10)], remote(12), AnchorUpload.SYNC)  # interval has its anchor


def test_a_failing_upload_backs_off_and_is_never_given_up() -> None:
    retry = UploadRetry(base_s=5.0, max_s=60.0)
    assert [retry.delay(n) for n in (1, 2, 3, 4, 5, 50)] == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0]
    assert not retry.due(2, failed_at=100.0, now=109.0) and retry.due(2, failed_at=100.0, now=110.0)


def test_local_keep_last_is_validated() -> None:
    with pytest.raises(
        ConfigurationError, match=r"mirror\.local_keep_last=0 would delete the checkpoint being written"
    ):
        TieredPolicy(RetentionPolicy(keep_last=1), local_keep_last=0)


steps = st.lists(st.integers(1, 200), min_size=1, max_size=20, unique=True)


@settings(max_examples=200, deadline=None)
@given(steps, st.data(), st.integers(1, 4), st.one_of(st.none(), st.integers(1, 4)))
def test_local_retention_never_deletes_what_the_mirror_lacks_nor_the_newest(history, data, keep_last, local_keep):
    tiers = TieredPolicy(RetentionPolicy(keep_last=keep_last, anchor_every_n_steps=25), local_keep)
    records = [local(s) for s in sorted(history)]
    on_mirror = {name(r) for r in data.draw(st.lists(st.sampled_from(records), unique=True))}
    decisions = tiers.decide_local(records, on_mirror)
    assert [d.record for d in decisions] == records
    deleted = [d.record for d in decisions if not d.keep]
    assert all(name(r) in on_mirror for r in deleted)
    assert records[-1] not in deleted
    if local_keep is not None:  # locally no anchors: of the copies the mirror has, at most local_keep_last stay
        assert len([d for d in decisions if d.keep and name(d.record) in on_mirror]) <= local_keep
