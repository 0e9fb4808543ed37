"""What each cloud's metadata service is asked, and what its answers mean, as pure data and functions.

For AWS (IMDSv2), Google Compute Engine and Azure (Scheduled Events) this module holds the documented
requests (``CloudAPI``: paths, headers, the AWS token step) and one parser per endpoint, which turns
``(HTTP status, body bytes, seen_at)`` into a ``Notice``, ``None`` (nothing announced), or raises
``MalformedAnswer`` saying what was wrong. ``deadline_verdict`` decides whether a notice's deadline is
still ahead, just passed, or so far past that the notice is stale. Nothing here opens a socket, reads a
clock or a file: ``seen_at`` (wall-clock seconds since the epoch) is passed in, and the poller
(``lightning_resume.cloud.poller``) does the HTTP.

Two kinds of notice: ``"preempt"`` (the instance goes away: save and stop) and ``"advisory"`` (an AWS
rebalance recommendation or a GCE live migration: save, keep training). Deadlines are wall-clock times,
comparable with ``time.time()``; ``None`` when the cloud gives none.
"""

from __future__ import annotations

import email.utils
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Literal, Optional

from lightning_resume.errors import LightningResumeError

NoticeKind = Literal["preempt", "advisory"]
PREEMPT: NoticeKind = "preempt"
ADVISORY: NoticeKind = "advisory"

MAX_BODY = 64 * 1024
"""The largest answer read. Real ones are under 1 KiB (an Azure document lists a few events)."""

GCE_PREEMPT_NOTICE_S = 30.0
"""GCE stops a preempted (Spot) VM about 30 s after ``preempted`` turns TRUE; it gives no time of its own."""
GCE_MAINTENANCE_NOTICE_S = 60.0
"""GCE announces ``TERMINATE_ON_HOST_MAINTENANCE`` 60 s ahead; it gives no time of its own."""

MAX_HEADER_VALUE = 1024
"""The longest header value sent. Every value sent is a constant or an AWS token (56 characters in practice)."""

STALE_AFTER_S = 120.0
"""A preempt deadline further in the past than this means the notice outlived its instance stop (an AWS
instance stopped and started again, a clock far off): acting on it would stop every restart at once."""


class MalformedAnswer(LightningResumeError, ValueError):
    """A metadata answer that cannot be read as the cloud documents it; ``url`` is the endpoint's path
    (the poller, which knows the base, names the whole URL when it reports it)."""

    def __init__(self, url: str, problem: str) -> None:
        self.url = url
        self.problem = problem
        super().__init__(f"{url}: {problem}")


@dataclass(frozen=True)
class Notice:
    """One announcement from a cloud: ``kind`` ``"preempt"`` (stop) or ``"advisory"`` (save, go on);
    ``deadline`` and ``seen_at`` in wall-clock seconds since the epoch; ``detail`` for the log line."""

    cloud: str
    kind: NoticeKind
    deadline: Optional[float]
    detail: str
    seen_at: float


Parser = Callable[[int, bytes, float], Optional[Notice]]


@dataclass(frozen=True)
class Request:
    """One documented HTTP request, relative to the cloud's base URL."""

    method: str
    path: str
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Probe:
    """An endpoint polled for notices and the parser of its answers."""

    request: Request
    parse: Parser


@dataclass(frozen=True)
class CloudAPI:
    """How to ask one cloud. ``token``: a request made first whose answer, read by ``parse_token``, is sent
    with every probe in the ``token_header`` header, and made again when a probe is answered 401 (AWS IMDSv2)."""

    name: str
    default_base: str
    probes: tuple[Probe, ...]
    token: Optional[Request] = None
    parse_token: Optional[Callable[[int, bytes], str]] = None
    token_header: str = ""


# ----------------------------------------------------------------------------------------- helpers


def _check_status(url: str, status: int, body: bytes, allowed: tuple[int, ...]) -> None:
    if status not in allowed:
        raise MalformedAnswer(url, f"HTTP {status}, expected {' or '.join(map(str, allowed))}")
    if len(body) > MAX_BODY:
        raise MalformedAnswer(url, f"answer longer than {MAX_BODY} bytes")


def _text(url: str, body: bytes) -> str:
    try:
        return body.decode("utf-8").strip()
    except UnicodeDecodeError as err:
        raise MalformedAnswer(url, f"answer is not UTF-8 text ({err})") from err


def _json_object(url: str, body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(_text(url, body))
    except (ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError; deep nesting recurses
        raise MalformedAnswer(url, f"answer is not JSON ({err})") from err
    if not isinstance(value, dict):
        raise MalformedAnswer(url, f"answer is JSON {type(value).__name__}, expected an object")
    return value


def _string_field(url: str, obj: dict[str, Any], name: str) -> str:
    if name not in obj:
        raise MalformedAnswer(url, f"field {name!r} missing (fields: {sorted(obj)!r})")
    value = obj[name]
    if not isinstance(value, str):
        raise MalformedAnswer(url, f"field {name!r} is {type(value).__name__} {value!r}, expected a string")
    return value


def _epoch(moment: datetime) -> float:
    # A time without a zone is read as UTC: every cloud here writes UTC, and a lost notice costs more.
    return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()


def _iso_time(url: str, name: str, text: str) -> float:
    """``2017-09-18T08:22:00Z`` (Python 3.10's ``fromisoformat`` does not read the ``Z``)."""
    try:
        return _epoch(datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text))
    except ValueError as err:
        raise MalformedAnswer(url, f"field {name!r} = {text!r} is not an ISO 8601 time") from err


def _rfc1123_time(url: str, name: str, text: str) -> float:
    """``Mon, 19 Sep 2016 18:29:47 GMT``."""
    try:
        return _epoch(email.utils.parsedate_to_datetime(text))
    except (TypeError, ValueError, IndexError) as err:
        raise MalformedAnswer(url, f"field {name!r} = {text!r} is not an RFC 1123 time") from err


def header_value_problem(value: str) -> Optional[str]:
    """Why ``value`` cannot be sent as an HTTP header value, or ``None`` when it can: it must be printable
    ASCII without spaces (what every documented value and an IMDSv2 token are), 1 to ``MAX_HEADER_VALUE`` long."""
    if not value:
        return "it is empty"
    if len(value) > MAX_HEADER_VALUE:
        return f"it is {len(value)} characters long, more than {MAX_HEADER_VALUE}"
    if not all(" " < c <= "~" for c in value):
        return "it is not printable ASCII without spaces"
    return None


# --------------------------------------------------------------------------------------------- AWS

AWS_TOKEN_PATH = "/latest/api/token"
AWS_TOKEN_TTL_S = 21600
AWS_TOKEN_HEADER = "X-aws-ec2-metadata-token"
AWS_INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
AWS_REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"


def parse_aws_token(status: int, body: bytes) -> str:
    """The IMDSv2 session token from the answer to ``PUT /latest/api/token``: a value it is safe to send back
    as a header (``header_value_problem``), or ``MalformedAnswer``."""
    _check_status(AWS_TOKEN_PATH, status, body, (200,))
    token = _text(AWS_TOKEN_PATH, body)
    problem = header_value_problem(token)
    if problem is not None:
        raise MalformedAnswer(AWS_TOKEN_PATH, f"token {token[:64]!r} refused: {problem}")
    return token


def parse_aws_instance_action(status: int, body: bytes, seen_at: float) -> Optional[Notice]:
    """404 until a Spot stop is scheduled, then ``{"action": "terminate"|"stop"|"hibernate", "time": ...}``."""
    url = AWS_INSTANCE_ACTION_PATH
    _check_status(url, status, body, (200, 404))
    if status == 404:
        return None
    answer = _json_object(url, body)
    action, when = _string_field(url, answer, "action"), _string_field(url, answer, "time")
    deadline = _iso_time(url, "time", when)
    return Notice("aws", PREEMPT, deadline, f"spot instance-action {action!r} at {when}", seen_at)


def parse_aws_rebalance(status: int, body: bytes, seen_at: float) -> Optional[Notice]:
    """404, or ``{"noticeTime": ...}``: capacity is short, a stop may follow (advisory, no deadline)."""
    url = AWS_REBALANCE_PATH
    _check_status(url, status, body, (200, 404))
    if status == 404:
        return None
    when = _string_field(url, _json_object(url, body), "noticeTime")
    _iso_time(url, "noticeTime", when)
    return Notice("aws", ADVISORY, None, f"rebalance recommendation of {when}", seen_at)


AWS = CloudAPI(
    name="aws",
    default_base="http://169.254.169.254",
    probes=(
        Probe(Request("GET", AWS_INSTANCE_ACTION_PATH), parse_aws_instance_action),
        Probe(Request("GET", AWS_REBALANCE_PATH), parse_aws_rebalance),
    ),
    token=Request("PUT", AWS_TOKEN_PATH, (("X-aws-ec2-metadata-token-ttl-seconds", str(AWS_TOKEN_TTL_S)),)),
    parse_token=parse_aws_token,
    token_header=AWS_TOKEN_HEADER,
)

# --------------------------------------------------------------------------------------------- GCE

GCE_HEADERS = (("Metadata-Flavor", "Google"),)
GCE_PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
GCE_MAINTENANCE_PATH = "/computeMetadata/v1/instance/maintenance-event"


def parse_gce_preempted(status: int, body: bytes, seen_at: float) -> Optional[Notice]:
    """``FALSE``, or ``TRUE`` once the Spot/preemptible VM is being stopped (about 30 s left)."""
    url = GCE_PREEMPTED_PATH
    _check_status(url, status, body, (200,))
    value = _text(url, body)
    if value == "FALSE":
        return None
    if value != "TRUE":
        raise MalformedAnswer(url, f"answer {value!r}, expected 'TRUE' or 'FALSE'")
    return Notice("gcp", PREEMPT, seen_at + GCE_PREEMPT_NOTICE_S, "instance preempted", seen_at)


def parse_gce_maintenance(status: int, body: bytes, seen_at: float) -> Optional[Notice]:
    """``NONE``, ``MIGRATE_ON_HOST_MAINTENANCE`` (advisory: a live migration) or
    ``TERMINATE_ON_HOST_MAINTENANCE`` (preempt: the VM stops in about 60 s)."""
    url = GCE_MAINTENANCE_PATH
    _check_status(url, status, body, (200,))
    value = _text(url, body)
    if value == "NONE":
        return None
    if value == "TERMINATE_ON_HOST_MAINTENANCE":
        return Notice("gcp", PREEMPT, seen_at + GCE_MAINTENANCE_NOTICE_S, f"maintenance event {value}", seen_at)
    if value == "MIGRATE_ON_HOST_MAINTENANCE":
        return Notice("gcp", ADVISORY, None, f"maintenance event {value}", seen_at)
    raise MalformedAnswer(
        url, f"maintenance event {value!r} is not one of NONE, MIGRATE_/TERMINATE_ON_HOST_MAINTENANCE"
    )


GCP = CloudAPI(
    name="gcp",
    default_base="http://metadata.google.internal",
    probes=(
        Probe(Request("GET", GCE_PREEMPTED_PATH, GCE_HEADERS), parse_gce_preempted),
        Probe(Request("GET", GCE_MAINTENANCE_PATH, GCE_HEADERS), parse_gce_maintenance),
    ),
)

# ------------------------------------------------------------------------------------------- Azure

# Azure enables Scheduled Events for a VM at its first request, which Microsoft documents may take up to
# two minutes to answer: the first polls may time out (one warning from the poller) until it does.
AZURE_EVENTS_PATH = "/metadata/scheduledevents?api-version=2020-07-01"
AZURE_STOP_EVENTS = ("Preempt", "Terminate")
"""The event types after which this VM is gone. Reboot, Redeploy and Freeze are ignored: the VM comes back."""


def _azure_stop(url: str, event: Any, seen_at: float) -> Optional[Notice]:
    if not isinstance(event, dict):
        raise MalformedAnswer(url, f"event {event!r} is not an object")
    kind = _string_field(url, event, "EventType")
    if kind not in AZURE_STOP_EVENTS:
        return None
    not_before = _string_field(url, event, "NotBefore")
    # An empty NotBefore means the event has started: no time is left.
    deadline = _rfc1123_time(url, "NotBefore", not_before) if not_before else seen_at
    detail = (
        f"{kind} event {event.get('EventId', '?')} ({event.get('EventStatus', '?')}), not before"
        f" {not_before or 'now'}, resources {event.get('Resources', [])!r}"
    )
    return Notice("azure", PREEMPT, deadline, detail, seen_at)


def parse_azure_events(status: int, body: bytes, seen_at: float) -> Optional[Notice]:
    """The earliest Preempt or Terminate event of the Scheduled Events document, or ``None``.

    Events of other VMs of the same availability or scale set are listed too (their ``Resources`` name
    them); they are not filtered out: a needless save and stop costs less than a missed one.
    """
    url = AZURE_EVENTS_PATH
    _check_status(url, status, body, (200,))
    events = _json_object(url, body).get("Events")
    if not isinstance(events, list):
        raise MalformedAnswer(url, f"field 'Events' is {events!r}, expected a list")
    stops = [n for n in (_azure_stop(url, e, seen_at) for e in events) if n is not None]
    return min(stops, key=lambda n: n.deadline or seen_at, default=None)


AZURE = CloudAPI(
    name="azure",
    default_base="http://169.254.169.254",
    probes=(Probe(Request("GET", AZURE_EVENTS_PATH, (("Metadata", "true"),)), parse_azure_events),),
)

APIS: dict[str, CloudAPI] = {api.name: api for api in (AWS, GCP, AZURE)}
"""Every supported cloud by name; its keys are ``detect.CLOUDS``."""

# ---------------------------------------------------------------------------------------- deadline

DeadlineVerdict = Literal["ahead", "late", "stale"]


def deadline_verdict(notice: Notice, now: float, stale_after_s: float = STALE_AFTER_S) -> DeadlineVerdict:
    """``"ahead"``: no deadline, or one still to come. ``"late"``: passed by up to ``stale_after_s``
    (a slow poll, a little clock skew): act at once. ``"stale"``: passed by more, see ``STALE_AFTER_S``."""
    if notice.deadline is None or notice.deadline >= now:
        return "ahead"
    return "late" if now - notice.deadline <= stale_after_s else "stale"
