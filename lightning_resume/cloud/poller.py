"""Polling the clouds' metadata services for preemption notices, on a daemon thread of its own.

``NoticePoller`` asks each configured cloud's endpoints (``protocols.APIS``) every ``interval_s``
and keeps what it learns: the first preempt notice (``notice``), and the latest advisory not yet taken
(``take_advisory``). The owner reads them at step boundaries; the training thread never waits on the
network. ``on_notice`` is called from the poller thread and must only set a flag.

What this module owns, and why:

- The HTTP, through ``fetch.fetch``: no environment proxy (a link-local metadata address sent through
  ``HTTP_PROXY`` would reach the proxy, not this instance, and hand the proxy the AWS token), no redirect
  followed, and ``timeout_s`` a deadline on each whole answer (connect, headers and body), so an endpoint
  that drips its answer costs one ``timeout_s`` and the next poll goes on. An explicit ``endpoint`` is used
  exactly as given (to go through a proxy, name it there). Answers are read up to ``protocols.MAX_BODY`` bytes.
- The AWS IMDSv2 token: fetched before the first probe, sent with each, fetched again on a 401. A token that
  is not printable ASCII of bounded length is refused (warned once) and a new one asked at the next probe.
  (In a container behind an instance whose IMDS hop limit is 1, the token request gets no answer: that is
  reported as a timeout.)
- Advisories: grouped into episodes per endpoint (``episodes.next_episode``); one advisory is handed out
  per episode, so a flapping endpoint costs at most one snapshot per ``advisory_quiet_s``.
- Failure reporting: a malformed answer, an unreachable or hanging endpoint, a late or stale deadline,
  an error in ``on_notice`` each emit one ``PreemptionWarning`` per kind and URL (``warnings``, like the
  rest of lightning-resume, so one filter covers the product), and polling goes on. Each probe fails on
  its own: nothing one endpoint answers stops the others from being asked. Nothing is raised out of the
  thread.
- Lifetime: a poller without clouds starts no thread and opens no socket. After a preempt notice the
  thread ends (there is nothing more to learn). ``stop`` signals and joins it.
"""

from __future__ import annotations

import http.client
import threading
import time
import warnings
from typing import Callable, Iterable, Optional, Sequence

from lightning_resume.cloud.detect import validate_clouds
from lightning_resume.cloud.episodes import ADVISORY_QUIET_S, Episode, next_episode
from lightning_resume.cloud.fetch import HeaderValueError, fetch
from lightning_resume.cloud.protocols import (
    ADVISORY,
    APIS,
    MAX_BODY,
    CloudAPI,
    MalformedAnswer,
    Notice,
    Probe,
    Request,
    deadline_verdict,
)
from lightning_resume.errors import ConfigurationError, PreemptionWarning

THREAD_NAME = "lightning-resume-notices"


def _failure_kind(err: BaseException) -> str:
    return "timeout" if isinstance(err, TimeoutError) else "unreachable"


def _validate(
    clouds: Sequence[str], endpoint: Optional[str], interval_s: float, timeout_s: float, advisory_quiet_s: float
) -> tuple[tuple[str, ...], list[str]]:
    problems: list[str] = []
    valid: tuple[str, ...] = ()
    try:
        valid = validate_clouds(list(clouds))
    except ValueError as err:
        problems.append(str(err))
    if endpoint is not None and not endpoint.startswith(("http://", "https://")):
        problems.append(f"endpoint={endpoint!r} is not an http:// or https:// URL; e.g. 'http://127.0.0.1:8080'")
    for name, value in (("interval_s", interval_s), ("timeout_s", timeout_s), ("advisory_quiet_s", advisory_quiet_s)):
        if not value > 0:  # also refuses NaN
            problems.append(f"{name}={value!r} must be a positive number of seconds")
    return valid, problems


class NoticePoller:
    """Polls ``clouds`` (names from ``detect.CLOUDS``, e.g. ``resolve_clouds("auto")``) for notices.

    ``endpoint`` replaces every cloud's base URL (a test server, a local relay). ``timeout_s`` is the
    deadline of each whole answer. ``wall_clock`` gives the ``seen_at`` of each notice (seconds since the
    epoch; the deadlines are on the same clock); ``clock`` (monotonic seconds) times advisory episodes,
    ``advisory_quiet_s`` apart at least (``episodes``).
    """

    def __init__(
        self,
        clouds: Sequence[str],
        endpoint: Optional[str] = None,
        interval_s: float = 5.0,
        timeout_s: float = 2.0,
        wall_clock: Callable[[], float] = time.time,
        on_notice: Optional[Callable[[Notice], None]] = None,
        advisory_quiet_s: float = ADVISORY_QUIET_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        valid, problems = _validate(clouds, endpoint, interval_s, timeout_s, advisory_quiet_s)
        if problems:
            raise ConfigurationError("NoticePoller", problems)
        self.clouds = valid
        self.endpoint = endpoint.rstrip("/") if endpoint is not None else None
        self.interval_s = float(interval_s)
        self.timeout_s = float(timeout_s)
        self.wall_clock = wall_clock
        self.on_notice = on_notice
        self.advisory_quiet_s, self.clock = float(advisory_quiet_s), clock
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._notice: Optional[Notice] = None
        self._advisory: Optional[Notice] = None
        self._episodes: dict[str, Optional[Episode]] = {}  # probe URL -> its current advisory episode
        self._tokens: dict[str, str] = {}
        self._reported: set[tuple[str, str]] = set()

    # ------------------------------------------------------------------------------ what it learned

    @property
    def notice(self) -> Optional[Notice]:
        """The first preempt notice seen (the instance goes: save and stop), ``None`` until then."""
        with self._lock:
            return self._notice

    def take_advisory(self) -> Optional[Notice]:
        """The latest advisory (save, keep training) not taken yet, which is then cleared; ``None`` if none.

        An advisory is handed out once per episode (``episodes``): one the cloud keeps answering poll after
        poll (AWS keeps a rebalance recommendation up), or that flaps, comes back only after it was gone for
        ``advisory_quiet_s``, or changed and that long passed since it was handed out.
        """
        with self._lock:
            advisory, self._advisory = self._advisory, None
            return advisory

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------------------------ lifetime

    def start(self) -> bool:
        """Start the polling thread; ``False`` (nothing started, no socket) without clouds or once a
        preempt notice was seen. Starting a running poller does nothing."""
        if not self.clouds or self.notice is not None:
            return False
        if not self.running:
            self._stopping.clear()
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()
        return True

    def stop(self, timeout: float = 5.0) -> bool:
        """Tell the thread to end and wait up to ``timeout`` s; ``True`` when it has ended. A request in
        flight is not interrupted: it ends within its deadline (``timeout_s``) and the (daemon) thread with it."""
        self._stopping.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return not self.running

    def __enter__(self) -> NoticePoller:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----------------------------------------------------------------------------------- internals

    def _run(self) -> None:
        while not self._stopping.is_set():
            began = time.monotonic()
            try:
                if self._poll_round() is not None:
                    return  # preempted: nothing more to learn
            except Exception as err:  # noqa: BLE001 - a bug here must not end the polling silently
                self._report_once("internal", "poller", f"notice poller error: {type(err).__name__}: {err}")
            self._stopping.wait(max(0.0, self.interval_s - (time.monotonic() - began)))

    def _poll_round(self) -> Optional[Notice]:
        for name in self.clouds:
            api = APIS[name]
            for probe in api.probes:
                if self._stopping.is_set() and threading.current_thread() is self._thread:
                    return self.notice
                try:
                    self._probe(api, probe)
                except Exception as err:  # noqa: BLE001 - one endpoint's failure must not stop the others
                    where = self._base(api) + probe.request.path
                    self._report_once("internal", where, f"notice poller error at {where}: {type(err).__name__}: {err}")
                if self.notice is not None:
                    return self.notice
        return None

    def _base(self, api: CloudAPI) -> str:
        return self.endpoint if self.endpoint is not None else api.default_base

    def _probe(self, api: CloudAPI, probe: Probe) -> None:
        url = self._base(api) + probe.request.path
        try:
            status, body = self._ask(api, probe.request)
            notice = probe.parse(status, body, self.wall_clock())
        except MalformedAnswer as err:  # the token's URL, when the token was refused
            where = self._base(api) + err.url
            self._report_once("malformed", where, f"{api.name} metadata answer unusable: {self._base(api)}{err}")
            return
        except HeaderValueError as err:
            self._report_once("header", url, f"{api.name} request to {url} not sent: {err}")
            return
        except (OSError, http.client.HTTPException) as err:  # TimeoutError is an OSError
            kind = _failure_kind(err)
            what = f"no answer within {self.timeout_s:g}s" if kind == "timeout" else "unreachable"
            self._report_once(kind, url, f"{api.name} metadata service {what} at {url}: {err}; polling goes on")
            return
        self._record(url, notice)

    def _ask(self, api: CloudAPI, request: Request) -> tuple[int, bytes]:
        if api.token is None or api.parse_token is None:
            return self._send(api, request, request.headers)
        status, body = 0, b""
        for _ in range(2):  # a 401 means the token expired (or the service restarted): one new token
            token = self._tokens.get(api.name) or self._fetch_token(api, api.token, api.parse_token)
            status, body = self._send(api, request, (*request.headers, (api.token_header, token)))
            if status != 401:
                break
            self._tokens.pop(api.name, None)
        return status, body

    def _fetch_token(self, api: CloudAPI, request: Request, parse: Callable[[int, bytes], str]) -> str:
        status, body = self._send(api, request, request.headers)
        token = parse(status, body)
        self._tokens[api.name] = token
        return token

    def _send(self, api: CloudAPI, request: Request, headers: Iterable[tuple[str, str]]) -> tuple[int, bytes]:
        return fetch(self._base(api) + request.path, request.method, headers, self.timeout_s, MAX_BODY + 1)

    def _record(self, url: str, notice: Optional[Notice]) -> None:
        if notice is None or notice.kind == ADVISORY:
            self._record_advisory(url, notice)
        else:
            self._record_preempt(url, notice)

    def _record_advisory(self, url: str, notice: Optional[Notice]) -> None:
        detail = None if notice is None else notice.detail
        episode, new = next_episode(self._episodes.get(url), detail, self.clock(), self.advisory_quiet_s)
        self._episodes[url] = episode
        if notice is None or not new:
            return  # nothing announced, or the episode already handed out
        with self._lock:
            self._advisory = notice
        self._notify(notice)

    def _record_preempt(self, url: str, notice: Notice) -> None:
        verdict = deadline_verdict(notice, notice.seen_at)
        if verdict != "ahead":
            past = notice.seen_at - (notice.deadline or notice.seen_at)
            action = "ignored as stale" if verdict == "stale" else "acted on at once (a late poll or clock skew?)"
            self._report_once(
                verdict, url, f"{notice.cloud} notice {past:.0f}s past its deadline, {action}: {notice.detail}"
            )
            if verdict == "stale":
                return
        with self._lock:
            self._notice = notice
        self._notify(notice)

    def _notify(self, notice: Notice) -> None:
        if self.on_notice is None:
            return
        try:
            self.on_notice(notice)
        except Exception as err:  # noqa: BLE001 - the owner's callback must not end the polling
            self._report_once("callback", "on_notice", f"on_notice raised {type(err).__name__}: {err}")

    def _report_once(self, kind: str, where: str, message: str) -> None:
        if (kind, where) in self._reported:
            return
        self._reported.add((kind, where))
        warnings.warn(message, PreemptionWarning, stacklevel=2)
