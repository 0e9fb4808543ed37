"""NoticePoller against a fake metadata service on 127.0.0.1 (tests/unit/cloud/conftest.py).

Every poller here is given ``endpoint=metadata.url``: no test reaches any other address.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import datetime, timezone

import pytest

from lightning_resume.cloud import NoticePoller, resolve_clouds
from lightning_resume.cloud.poller import THREAD_NAME
from lightning_resume.errors import ConfigurationError, PreemptionWarning

NOW = 1_700_000_000.0
"""The wall clock of these pollers (2023-11-14T22:13:20Z), so deadlines can be asserted exactly."""


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _rfc1123(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%a, %d %b %Y %H:%M:%S GMT")


def _aws_action(t: float, action: str = "terminate") -> bytes:
    return json.dumps({"action": action, "time": _iso(t)}).encode()


def _azure(*events: dict) -> bytes:
    return json.dumps({"DocumentIncarnation": 3, "Events": list(events)}).encode()


def _preempt_event(not_before: str) -> dict:
    return {
        "EventId": "e-1",
        "EventType": "Preempt",
        "ResourceType": "VirtualMachine",
        "Resources": ["vm-0"],
        "EventStatus": "Scheduled",
        "NotBefore": not_before,
        "Description": "Spot eviction",
        "EventSource": "Platform",
    }


def _ours(records) -> list[str]:
    return [str(r.message) for r in records if issubclass(r.category, PreemptionWarning)]


# -------------------------------------------------------------------------------- each cloud's API


def test_aws_notice_arrives_through_the_token_flow_with_its_deadline(metadata, make_poller, wait_until, caught):
    poller = make_poller(["aws"], endpoint=metadata.url, wall_clock=lambda: NOW)
    assert poller.start()
    wait_until(lambda: len(metadata.statuses("instance-action")) >= 3)
    assert poller.notice is None and metadata.statuses("instance-action")[:3] == [404, 404, 404]
    metadata.aws_action = _aws_action(NOW + 120)
    wait_until(lambda: poller.notice is not None)
    assert (poller.notice.cloud, poller.notice.kind, poller.notice.deadline) == ("aws", "preempt", NOW + 120)
    assert metadata.requests()[0][:2] == ("PUT", "/latest/api/token")
    gets = metadata.requests("/latest/meta-data/")
    assert gets and all(headers["x-aws-ec2-metadata-token"] == "token-1" for *_, headers in gets)
    assert metadata.tokens_issued == 1  # one token for all polls, not one per request
    wait_until(lambda: not poller.running)  # a preempt ends the polling: nothing more to learn
    assert _ours(caught) == []


def test_aws_expired_token_is_replaced_after_a_401(metadata, make_poller, wait_until, caught):
    poller = make_poller(["aws"], endpoint=metadata.url, wall_clock=lambda: NOW)
    poller.start()
    wait_until(lambda: metadata.tokens_issued == 1 and len(metadata.statuses("instance-action")) >= 1)
    metadata.rotate_aws_token()
    metadata.aws_action = _aws_action(NOW + 90, "stop")
    wait_until(lambda: poller.notice is not None)
    assert 401 in metadata.statuses("/latest/meta-data/") and metadata.tokens_issued == 2
    assert poller.notice.deadline == NOW + 90 and _ours(caught) == []


def test_aws_rebalance_is_an_advisory_handed_out_once_and_polling_goes_on(metadata, make_poller, wait_until):
    seen, clock = [], [0.0]
    poller = make_poller(
        ["aws"], endpoint=metadata.url, wall_clock=lambda: NOW, on_notice=seen.append, clock=lambda: clock[0]
    )
    poller.start()
    metadata.aws_rebalance = json.dumps({"noticeTime": _iso(NOW)}).encode()
    wait_until(lambda: seen)
    advisory = poller.take_advisory()
    assert advisory is not None and (advisory.kind, advisory.deadline) == ("advisory", None)
    polls = len(metadata.statuses("rebalance"))
    wait_until(lambda: len(metadata.statuses("rebalance")) >= polls + 3)
    assert poller.take_advisory() is None and len(seen) == 1  # still up, but the same announcement
    assert poller.running and poller.notice is None
    clock[0] = poller.advisory_quiet_s  # a new recommendation, once an episode's quiet period has passed
    metadata.aws_rebalance = json.dumps({"noticeTime": _iso(NOW + 600)}).encode()
    wait_until(lambda: len(seen) == 2)
    assert poller.take_advisory() is not None


def test_gce_preempted_turns_true_and_gives_thirty_seconds(metadata, make_poller, wait_until):
    poller = make_poller(["gcp"], endpoint=metadata.url, wall_clock=lambda: NOW)
    poller.start()
    wait_until(lambda: len(metadata.statuses("preempted")) >= 3)
    assert poller.notice is None
    metadata.gce_preempted = b"TRUE"
    wait_until(lambda: poller.notice is not None)
    assert (poller.notice.cloud, poller.notice.kind, poller.notice.deadline) == ("gcp", "preempt", NOW + 30)
    assert 403 not in metadata.statuses("/computeMetadata/")  # the Metadata-Flavor header was sent


def test_gce_maintenance_migrate_advises_and_terminate_preempts(metadata, make_poller, wait_until):
    poller = make_poller(["gcp"], endpoint=metadata.url, wall_clock=lambda: NOW)
    poller.start()
    metadata.gce_maintenance = b"MIGRATE_ON_HOST_MAINTENANCE"
    wait_until(lambda: poller.take_advisory() is not None)
    metadata.gce_maintenance = b"TERMINATE_ON_HOST_MAINTENANCE"
    wait_until(lambda: poller.notice is not None)
    assert (poller.notice.kind, poller.notice.deadline) == ("preempt", NOW + 60)


def test_azure_preempt_event_arrives_with_its_not_before(metadata, make_poller, wait_until, caught):
    poller = make_poller(["azure"], endpoint=metadata.url, wall_clock=lambda: NOW)
    poller.start()
    wait_until(lambda: len(metadata.statuses("scheduledevents")) >= 3)
    assert poller.notice is None
    metadata.azure_events = _azure(_preempt_event(_rfc1123(NOW + 30)))
    wait_until(lambda: poller.notice is not None)
    assert (poller.notice.cloud, poller.notice.kind, poller.notice.deadline) == ("azure", "preempt", NOW + 30)
    assert set(metadata.statuses("scheduledevents")) == {200}  # Metadata: true and the api-version were sent
    assert _ours(caught) == []


def test_the_fake_service_refuses_requests_without_the_documented_headers(metadata):
    """The checks above would prove nothing if the fake answered anyone."""
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    for path, status in [
        ("/computeMetadata/v1/instance/preempted", 403),
        ("/metadata/scheduledevents?api-version=2020-07-01", 400),
        ("/latest/meta-data/spot/instance-action", 401),
    ]:
        with pytest.raises(urllib.error.HTTPError) as info:
            opener.open(metadata.url + path, timeout=5)
        info.value.close()
        assert info.value.code == status


# ----------------------------------------------------------------------------------------- failures


def test_a_hanging_endpoint_costs_the_caller_nothing_and_is_reported_once(
    metadata, make_poller, wait_until, caught, monkeypatch
):
    metadata.hang_s = 600.0  # released at the server's stop: no answer ever comes while the test runs
    poller = make_poller(["gcp"], endpoint=metadata.url, timeout_s=0.2)
    senders = []  # the thread of every request: the caller's never asks (bound by who works, not by seconds)
    send = NoticePoller._send
    monkeypatch.setattr(
        NoticePoller, "_send", lambda self, *a: senders.append(threading.current_thread()) or send(self, *a)
    )
    poller.start()
    wait_until(lambda: len(metadata.requests("/computeMetadata/")) >= 4, timeout=60)  # it keeps trying
    timeouts = [m for m in _ours(caught) if "no answer within 0.2s" in m]
    assert len(timeouts) == 2  # once per endpoint, however many polls timed out
    assert poller.stop(timeout=60)  # the thread ends although the endpoint never answered
    assert senders and threading.main_thread() not in senders and not metadata.release.is_set()


def test_after_a_hang_a_later_answer_is_still_seen(metadata, make_poller, wait_until, caught):
    metadata.hang_s = 30.0
    poller = make_poller(["gcp"], endpoint=metadata.url, timeout_s=0.2, wall_clock=lambda: NOW)
    poller.start()
    wait_until(lambda: _ours(caught))
    metadata.gce_preempted = b"TRUE"
    metadata.hang_s = 0.0
    metadata.release.set()
    wait_until(lambda: poller.notice is not None)
    assert poller.notice.deadline == NOW + 30


def test_an_unreachable_endpoint_is_reported_once(make_poller, wait_until, caught):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    poller = make_poller(["azure"], endpoint=f"http://127.0.0.1:{port}")
    poller.start()
    time.sleep(0.5)  # about ten polls
    poller.stop()
    assert len([m for m in _ours(caught) if "unreachable" in m]) == 1


@pytest.mark.parametrize(
    ("cloud", "field", "bad", "good", "deadline"),
    [
        ("aws", "aws_action", b"{bad json", _aws_action(NOW + 120), NOW + 120),
        ("aws", "aws_action", b'{"action": "terminate"}', _aws_action(NOW + 120), NOW + 120),
        (
            "azure",
            "azure_events",
            _azure(_preempt_event("next week")),
            _azure(_preempt_event(_rfc1123(NOW + 30))),
            NOW + 30,
        ),
        ("gcp", "gce_preempted", b"PERHAPS", b"TRUE", NOW + 30),
    ],
    ids=["aws-bad-json", "aws-missing-time", "azure-bad-not-before", "gce-bad-value"],
)
def test_a_malformed_answer_is_reported_once_and_a_later_good_one_is_seen(
    metadata, make_poller, wait_until, caught, cloud, field, bad, good, deadline
):
    setattr(metadata, field, bad)
    poller = make_poller([cloud], endpoint=metadata.url, wall_clock=lambda: NOW)
    poller.start()
    wait_until(lambda: len(metadata.requests("/latest/meta-data/spot" if cloud == "aws" else "/")) >= 5)
    assert poller.notice is None and poller.running
    reports = _ours(caught)
    assert len(reports) == 1 and metadata.url in reports[0] and "unusable" in reports[0]
    setattr(metadata, field, good)
    wait_until(lambda: poller.notice is not None)
    assert poller.notice.deadline == deadline


def test_a_redirect_is_not_followed(metadata, make_poller, wait_until, caught):
    metadata.redirect_to = metadata.url + "/elsewhere"
    poller = make_poller(["gcp"], endpoint=metadata.url)
    poller.start()
    wait_until(lambda: len(metadata.requests()) >= 4)
    assert not metadata.requests("/elsewhere")
    poller.stop()
    assert any("HTTP 302" in m for m in _ours(caught))


def test_a_deadline_just_passed_is_acted_on_at_once_with_a_warning(metadata, make_poller, wait_until, caught):
    metadata.aws_action = _aws_action(NOW - 10)
    poller = make_poller(["aws"], endpoint=metadata.url, wall_clock=lambda: NOW)
    poller.start()
    wait_until(lambda: poller.notice is not None)
    assert poller.notice.deadline == NOW - 10
    reports = _ours(caught)
    assert len(reports) == 1 and "10s past its deadline, acted on at once" in reports[0]


def test_a_long_past_deadline_is_stale_reported_once_and_polling_goes_on(metadata, make_poller, wait_until, caught):
    metadata.aws_action = b'{"action": "stop", "time": "2017-09-18T08:22:00Z"}'
    poller = make_poller(["aws"], endpoint=metadata.url, wall_clock=lambda: NOW)
    poller.start()
    wait_until(lambda: len(metadata.statuses("instance-action")) >= 5)
    assert poller.notice is None and poller.running
    reports = _ours(caught)
    assert len(reports) == 1 and "ignored as stale" in reports[0]
    metadata.aws_action = _aws_action(NOW + 120)
    wait_until(lambda: poller.notice is not None)
    assert poller.notice.deadline == NOW + 120


def test_an_on_notice_that_raises_is_reported_and_the_notice_kept(metadata, make_poller, wait_until, caught):
    def boom(notice):
        raise RuntimeError("consumer bug")

    metadata.gce_preempted = b"TRUE"
    poller = make_poller(["gcp"], endpoint=metadata.url, on_notice=boom)
    poller.start()
    wait_until(lambda: poller.notice is not None and not poller.running)
    assert any("consumer bug" in m for m in _ours(caught))


def test_proxies_from_the_environment_are_not_used(metadata, make_poller, wait_until, monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # the discard port: a proxy there answers nothing
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    metadata.gce_preempted = b"TRUE"
    poller = make_poller(["gcp"], endpoint=metadata.url)
    poller.start()
    wait_until(lambda: poller.notice is not None)


# ------------------------------------------------------------------------------------- lifecycle


def test_without_clouds_no_thread_starts_and_no_socket_is_opened(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a socket was connected")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    clouds = resolve_clouds("auto", dmi_dir=str(tmp_path))
    assert clouds == ()
    poller = NoticePoller(clouds)
    assert poller.start() is False and not poller.running
    assert not [t for t in threading.enumerate() if t.name == THREAD_NAME]
    assert poller.notice is None and poller.stop()


def test_the_no_socket_check_can_fail(metadata, monkeypatch, caught, make_poller, wait_until):
    """The patch above does catch a connect: the same poller with a cloud is refused."""

    def refuse(*args, **kwargs):
        raise OSError("connect refused by the test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    make_poller(["gcp"], endpoint=metadata.url).start()
    wait_until(lambda: any("connect refused by the test" in m for m in _ours(caught)))


def test_the_thread_is_a_named_daemon_and_stop_ends_it(metadata, make_poller):
    poller = make_poller(["azure"], endpoint=metadata.url)
    poller.start()
    threads = [t for t in threading.enumerate() if t.name == THREAD_NAME]
    assert len(threads) == 1 and threads[0].daemon
    assert poller.start()  # already running: nothing more is started
    assert len([t for t in threading.enumerate() if t.name == THREAD_NAME]) == 1
    assert poller.stop(timeout=60) and not poller.running


def test_invalid_options_are_all_named_at_once():
    with pytest.raises(ConfigurationError) as info:
        NoticePoller(["aws", "ibm"], endpoint="169.254.169.254", interval_s=0, timeout_s=float("nan"))
    text = str(info.value)
    assert "'ibm'" in text and "endpoint=" in text and "interval_s=0" in text and "timeout_s=nan" in text
