"""Notices an endpoint cannot hide or abuse, against the fake metadata service on 127.0.0.1 (conftest.py).

A dripped answer is cut by the deadline on the whole answer, and the next poll sees the notice; a token that
is not a safe header value is refused, warned once, and the next token works; one cloud's failure never
stops another from being asked; a flapping advisory is handed out once per episode. Work is bounded by
counting the requests the service received, never by seconds (the waits are liveness timeouts only).
"""

from __future__ import annotations

import json

import pytest

from lightning_resume.errors import PreemptionWarning

NOW = 1_700_000_000.0


def _ours(records) -> list[str]:
    return [str(r.message) for r in records if issubclass(r.category, PreemptionWarning)]


@pytest.mark.parametrize("phase", ["status", "body"])
def test_a_notice_after_a_dripped_answer_is_seen_at_the_next_poll(metadata, make_poller, wait_until, caught, phase):
    """The first answer drips a byte every 50 ms forever: each read gets data well within the 0.5 s timeout,
    so only a deadline on the whole answer ends it. The notice is then seen by the very next poll."""
    metadata.gce_preempted = b"TRUE"
    metadata.drip_answers, metadata.drip_phase = 1, phase
    poller = make_poller(["gcp"], endpoint=metadata.url, timeout_s=0.5, wall_clock=lambda: NOW)
    poller.start()
    wait_until(lambda: poller.notice is not None)
    assert poller.notice.deadline == NOW + 30
    assert len(metadata.requests("/instance/preempted")) == 2  # the dripped one, then the one with the notice
    assert any("no answer within 0.5s" in m for m in _ours(caught))


def test_a_dripping_endpoint_never_keeps_another_cloud_from_being_asked(metadata, make_poller, wait_until, caught):
    metadata.drip_answers = 1_000_000  # every GCE answer (and every other GET) drips
    poller = make_poller(["gcp", "azure"], endpoint=metadata.url, timeout_s=0.3)
    poller.start()
    wait_until(lambda: len(metadata.requests("scheduledevents")) >= 2)  # asked round after round
    assert len(metadata.requests("/computeMetadata/")) >= 4


def test_a_token_outside_latin_1_is_refused_once_and_the_next_token_works(metadata, make_poller, wait_until, caught):
    metadata.bad_tokens = ["tok\u20acen".encode()]  # UTF-8 text that http.client cannot send as latin-1
    metadata.aws_action = json.dumps({"action": "terminate", "time": "2023-11-14T22:15:20Z"}).encode()
    poller = make_poller(["aws"], endpoint=metadata.url, wall_clock=lambda: NOW)
    poller.start()
    wait_until(lambda: poller.notice is not None)
    assert poller.notice.deadline == NOW + 120 and metadata.tokens_issued == 2
    reports = _ours(caught)
    assert len(reports) == 1 and "/latest/api/token" in reports[0] and "not printable ASCII" in reports[0]
    assert all("\u20ac" not in h.get("x-aws-ec2-metadata-token", "") for *_, h in metadata.requests())


def test_bad_tokens_forever_never_keep_another_cloud_from_being_asked(metadata, make_poller, wait_until, caught):
    metadata.bad_tokens = ["tok\u20acen".encode()] * 1_000_000
    metadata.gce_preempted = b"TRUE"
    poller = make_poller(["aws", "gcp"], endpoint=metadata.url, wall_clock=lambda: NOW)
    poller.start()
    wait_until(lambda: poller.notice is not None)
    assert poller.notice.cloud == "gcp"
    assert len([m for m in _ours(caught) if "/latest/api/token" in m]) == 1  # warned once, however many


def _rebalance(minute: int) -> bytes:
    return json.dumps({"noticeTime": f"2023-11-14T22:{minute:02d}:00Z"}).encode()


@pytest.mark.parametrize("new_time", [False, True], ids=["same-notice-time", "new-notice-time-each-time"])
def test_a_flapping_advisory_is_handed_out_once(metadata, make_poller, wait_until, new_time):
    """Answered, gone, answered again, 20 times over: one episode, so one snapshot (the README's promise)."""
    metadata.rebalance_script = [_rebalance(i if new_time else 0) if i % 2 == 0 else None for i in range(40)]
    seen = []
    poller = make_poller(["aws"], endpoint=metadata.url, wall_clock=lambda: NOW, on_notice=seen.append)
    poller.start()
    wait_until(lambda: not metadata.rebalance_script and len(metadata.requests("/rebalance")) >= 41)
    assert len(seen) == 1 and poller.take_advisory() is not None and poller.take_advisory() is None


def test_an_advisory_after_a_quiet_period_is_a_new_episode(metadata, make_poller, wait_until):
    clock = [0.0]
    seen = []
    poller = make_poller(
        ["gcp"], endpoint=metadata.url, on_notice=seen.append, advisory_quiet_s=600.0, clock=lambda: clock[0]
    )
    poller.start()
    metadata.gce_maintenance = b"MIGRATE_ON_HOST_MAINTENANCE"
    wait_until(lambda: seen)
    metadata.gce_maintenance = b"NONE"
    polls = len(metadata.requests("maintenance-event"))
    wait_until(lambda: len(metadata.requests("maintenance-event")) >= polls + 2)
    clock[0] = 600.0  # the migration is long over
    metadata.gce_maintenance = b"MIGRATE_ON_HOST_MAINTENANCE"
    wait_until(lambda: len(seen) == 2)
