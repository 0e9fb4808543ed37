"""The parsers of the three clouds' metadata answers, and the deadline verdict: pure, no server."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from lightning_resume.cloud import Notice
from lightning_resume.cloud.protocols import (
    AWS_INSTANCE_ACTION_PATH,
    AZURE_EVENTS_PATH,
    MAX_BODY,
    STALE_AFTER_S,
    MalformedAnswer,
    deadline_verdict,
    parse_aws_instance_action,
    parse_aws_rebalance,
    parse_aws_token,
    parse_azure_events,
    parse_gce_maintenance,
    parse_gce_preempted,
)

SEEN = 1_700_000_000.0


def _utc(*args: int) -> float:
    return datetime(*args, tzinfo=timezone.utc).timestamp()


def _events(*events: dict) -> bytes:
    return json.dumps({"DocumentIncarnation": 2, "Events": list(events)}).encode()


def _event(kind: str = "Preempt", not_before: str = "Mon, 19 Sep 2016 18:29:47 GMT", **extra) -> dict:
    return {
        "EventId": "602d9444-d2cd-49c7-8624-8643e7171297",
        "EventType": kind,
        "ResourceType": "VirtualMachine",
        "Resources": ["vm-0"],
        "EventStatus": "Scheduled",
        "NotBefore": not_before,
        **extra,
    }


# --------------------------------------------------------------------------------------------- AWS


def test_aws_instance_action_gives_a_preempt_at_its_time():
    body = b'{"action": "terminate", "time": "2017-09-18T08:22:00Z"}'
    notice = parse_aws_instance_action(200, body, SEEN)
    assert notice == Notice("aws", "preempt", _utc(2017, 9, 18, 8, 22), notice.detail, SEEN)
    assert "terminate" in notice.detail
    assert parse_aws_instance_action(404, b"<html>Not Found</html>", SEEN) is None


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"{not json", "not JSON"),
        (b'{"action": "stop"}', "'time' missing"),
        (b'{"action": "stop", "time": "soon"}', "not an ISO 8601 time"),
        (b'{"action": "stop", "time": 1505722920}', "expected a string"),
        (b'["stop"]', "expected an object"),
        (b"[" * 5000 + b"]" * 5000, "not JSON"),
        (b"\xff\xfe", "not UTF-8"),
    ],
)
def test_a_malformed_aws_answer_is_refused_naming_the_url_and_the_problem(body, problem):
    with pytest.raises(MalformedAnswer) as info:
        parse_aws_instance_action(200, body, SEEN)
    assert isinstance(info.value, ValueError)
    assert AWS_INSTANCE_ACTION_PATH in str(info.value) and problem in str(info.value)


def test_an_unexpected_status_or_an_oversized_answer_is_malformed():
    with pytest.raises(MalformedAnswer, match="HTTP 500, expected 200 or 404"):
        parse_aws_instance_action(500, b"", SEEN)
    with pytest.raises(MalformedAnswer, match="longer than"):
        parse_aws_instance_action(200, b" " * (MAX_BODY + 1), SEEN)


def test_aws_rebalance_recommendation_is_an_advisory_without_deadline():
    notice = parse_aws_rebalance(200, b'{"noticeTime": "2020-10-27T08:22:00Z"}', SEEN)
    assert notice is not None and (notice.kind, notice.deadline, notice.cloud) == ("advisory", None, "aws")
    assert parse_aws_rebalance(404, b"", SEEN) is None
    with pytest.raises(MalformedAnswer, match="noticeTime"):
        parse_aws_rebalance(200, b"{}", SEEN)


def test_aws_token_is_one_line_of_text():
    assert parse_aws_token(200, b"AQAEAK==\n") == "AQAEAK=="
    with pytest.raises(MalformedAnswer, match="HTTP 403"):
        parse_aws_token(403, b"")
    with pytest.raises(MalformedAnswer, match="empty"):
        parse_aws_token(200, b"")


# --------------------------------------------------------------------------------------------- GCE


def test_gce_preempted_true_gives_thirty_seconds():
    assert parse_gce_preempted(200, b"FALSE", SEEN) is None
    notice = parse_gce_preempted(200, b"TRUE", SEEN)
    assert notice is not None and (notice.cloud, notice.kind, notice.deadline) == ("gcp", "preempt", SEEN + 30)
    with pytest.raises(MalformedAnswer, match="'maybe'"):
        parse_gce_preempted(200, b"maybe", SEEN)
    with pytest.raises(MalformedAnswer, match="HTTP 403"):
        parse_gce_preempted(403, b"", SEEN)


def test_gce_maintenance_terminate_preempts_and_migrate_advises():
    assert parse_gce_maintenance(200, b"NONE", SEEN) is None
    terminate = parse_gce_maintenance(200, b"TERMINATE_ON_HOST_MAINTENANCE", SEEN)
    assert terminate is not None and (terminate.kind, terminate.deadline) == ("preempt", SEEN + 60)
    migrate = parse_gce_maintenance(200, b"MIGRATE_ON_HOST_MAINTENANCE", SEEN)
    assert migrate is not None and (migrate.kind, migrate.deadline) == ("advisory", None)
    with pytest.raises(MalformedAnswer, match="SOMETHING_NEW"):
        parse_gce_maintenance(200, b"SOMETHING_NEW", SEEN)


# ------------------------------------------------------------------------------------------- Azure


def test_azure_preempt_and_terminate_events_preempt_at_not_before():
    assert parse_azure_events(200, _events(), SEEN) is None
    notice = parse_azure_events(200, _events(_event("Preempt")), SEEN)
    assert notice is not None and (notice.cloud, notice.kind) == ("azure", "preempt")
    assert notice.deadline == _utc(2016, 9, 19, 18, 29, 47)
    terminate = parse_azure_events(200, _events(_event("Terminate", "Tue, 20 Sep 2016 10:00:00 GMT")), SEEN)
    assert terminate is not None and terminate.deadline == _utc(2016, 9, 20, 10)


def test_azure_other_events_are_ignored_and_the_earliest_stop_wins():
    ignored = [_event(kind) for kind in ("Reboot", "Redeploy", "Freeze")]
    assert parse_azure_events(200, _events(*ignored), SEEN) is None
    late, early = _event("Terminate", "Tue, 20 Sep 2016 10:00:00 GMT"), _event("Preempt")
    notice = parse_azure_events(200, _events(*ignored, late, early), SEEN)
    assert notice is not None and notice.deadline == _utc(2016, 9, 19, 18, 29, 47)


def test_azure_event_without_not_before_has_started_and_its_deadline_is_now():
    notice = parse_azure_events(200, _events(_event("Preempt", "", EventStatus="Started")), SEEN)
    assert notice is not None and notice.deadline == SEEN


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (_events(_event("Preempt", "next tuesday")), "not an RFC 1123 time"),
        (b'{"Events": {}}', "expected a list"),
        (b'{"DocumentIncarnation": 1}', "'Events'"),
        (_events({"EventType": "Preempt"}), "'NotBefore' missing"),
        (b'{"Events": ["Preempt"]}', "not an object"),
    ],
)
def test_a_malformed_azure_document_is_refused(body, problem):
    with pytest.raises(MalformedAnswer) as info:
        parse_azure_events(200, body, SEEN)
    assert AZURE_EVENTS_PATH in str(info.value) and problem in str(info.value)


# ---------------------------------------------------------------------------------------- deadline


def test_deadline_verdict_is_ahead_late_then_stale():
    def notice(deadline):
        return Notice("aws", "preempt", deadline, "", SEEN)

    assert deadline_verdict(notice(None), SEEN) == "ahead"
    assert deadline_verdict(notice(SEEN + 1), SEEN) == "ahead"
    assert deadline_verdict(notice(SEEN - 1), SEEN) == "late"
    assert deadline_verdict(notice(SEEN - STALE_AFTER_S), SEEN) == "late"
    assert deadline_verdict(notice(SEEN - STALE_AFTER_S - 1), SEEN) == "stale"
    assert deadline_verdict(notice(SEEN - 10), SEEN, stale_after_s=5) == "stale"


def test_notice_is_frozen():
    notice = Notice("gcp", "preempt", None, "", SEEN)
    with pytest.raises(AttributeError):
        notice.deadline = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ("tok\u20acen".encode(), "not printable ASCII"),  # outside latin-1: http.client cannot even encode it
        ("tok\u00e9n".encode(), "not printable ASCII"),
        (b"tok en", "not printable ASCII"),
        (b"tok\x7fen", "not printable ASCII"),
        (b"A" * 2000, "more than 1024"),
    ],
    ids=["euro", "latin-1", "space", "DEL", "too-long"],
)
def test_an_aws_token_that_is_not_a_safe_header_value_is_refused(body, problem):
    with pytest.raises(MalformedAnswer, match=problem) as info:
        parse_aws_token(200, body)
    assert "/latest/api/token" in str(info.value)
