"""A fake cloud metadata service on 127.0.0.1 speaking the three clouds' documented APIs, with state to flip.

AWS (IMDSv2 only: a GET without the current token is a 401, as on an instance with HttpTokens=required),
GCE (403 without ``Metadata-Flavor: Google``), Azure Scheduled Events (400 without ``Metadata: true`` or
with another api-version). ``hang_s`` makes every answer wait (released at stop); ``drip_answers`` makes the
next GET answers drip a byte at a time, forever (until the client gives up or the server stops);
``bad_tokens`` are issued before good AWS tokens; ``rebalance_script`` answers the rebalance endpoint one
entry per request (``None``: 404) before ``aws_rebalance`` does. Tests never reach any
other address: every poller is given ``endpoint=metadata.url``. Used by the poller's unit tests and by the
kill-and-resume tests of ``ExactResume(preemption=PreemptionOptions(notices=...))``; ``fake_dmi`` writes the DMI evidence of
a cloud for ``"auto"``.
"""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator, Optional
from urllib.parse import parse_qs, urlsplit

NO_EVENTS = json.dumps({"DocumentIncarnation": 1, "Events": []}).encode()


@dataclass
class FakeMetadata:
    url: str = ""
    aws_token: str = ""
    tokens_issued: int = 0
    aws_action: Optional[bytes] = None  # None: 404 (no stop scheduled)
    aws_rebalance: Optional[bytes] = None
    gce_preempted: bytes = b"FALSE"
    gce_maintenance: bytes = b"NONE"
    azure_events: bytes = NO_EVENTS
    redirect_to: Optional[str] = None
    hang_s: float = 0.0
    drip_answers: int = 0  # the next this many GETs are dripped, one byte per drip_every_s
    drip_phase: str = "body"  # "status": the status line itself drips; "body": whole headers, then the body
    drip_every_s: float = 0.05
    bad_tokens: list = field(default_factory=list)  # bytes issued as AWS tokens, in order, before good ones
    rebalance_script: list = field(default_factory=list)  # bytes or None (404), one per rebalance GET
    release: threading.Event = field(default_factory=threading.Event)
    log: list = field(default_factory=list)  # (method, path, status, headers by lower-case name)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def statuses(self, path_part: str) -> list[int]:
        with self.lock:
            return [status for _, path, status, _ in self.log if path_part in path]

    def requests(self, path_part: str = "") -> list[tuple]:
        with self.lock:
            return [entry for entry in self.log if path_part in entry[1]]

    def rotate_aws_token(self) -> None:
        """As if the token had expired: the one the poller holds is refused from now on."""
        self.aws_token = "expired-" + self.aws_token


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _answer(self, status: int, body: bytes = b"", extra: Optional[dict] = None) -> None:
        state = self.server.state
        with state.lock:
            state.log.append((self.command, self.path, status, {k.lower(): v for k, v in self.headers.items()}))
        if state.hang_s:
            state.release.wait(state.hang_s)
        if self.command == "GET" and self._take_drip():
            return self._drip(body)
        try:
            self.send_response(status)
            for key, value in (extra or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # the client gave up (a timeout under test)

    def _take_drip(self) -> bool:
        state = self.server.state
        with state.lock:
            if state.drip_answers <= 0:
                return False
            state.drip_answers -= 1
            return True

    def _drip(self, body: bytes) -> None:
        """Send a byte every ``drip_every_s`` until the client goes or the server stops: each read the client
        makes gets data in time, but the answer never ends."""
        state = self.server.state
        if state.drip_phase == "status":
            head, tail = b"", b"HTTP/1.0 200 OK\r\nX-Pad: " + b"a" * 60000
        else:
            head, tail = b"HTTP/1.0 200 OK\r\nContent-Length: 65536\r\n\r\n" + body, b"a" * 65536
        try:
            self.wfile.write(head)
            for i in range(len(tail)):
                if state.release.wait(state.drip_every_s):
                    return
                self.wfile.write(tail[i : i + 1])
        except OSError:
            pass  # the client gave up: what a deadline does

    def do_PUT(self) -> None:
        state = self.server.state
        if self.path != "/latest/api/token" or not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            return self._answer(400)
        state.tokens_issued += 1
        if state.bad_tokens:
            state.aws_token = ""  # nothing is accepted with a bad token (it should never be sent)
            return self._answer(200, state.bad_tokens.pop(0))
        state.aws_token = f"token-{state.tokens_issued}"
        self._answer(200, state.aws_token.encode())

    def do_GET(self) -> None:
        state = self.server.state
        path = urlsplit(self.path).path
        if state.redirect_to is not None:
            return self._answer(302, extra={"Location": state.redirect_to})
        if path.startswith("/latest/"):
            return self._aws(path)
        if path.startswith("/computeMetadata/v1/"):
            if self.headers.get("Metadata-Flavor") != "Google" or "X-Forwarded-For" in self.headers:
                return self._answer(403)
            bodies = {"preempted": state.gce_preempted, "maintenance-event": state.gce_maintenance}
            body = bodies.get(path.rsplit("/", 1)[-1])
            return self._answer(200, body) if body is not None else self._answer(404)
        if path == "/metadata/scheduledevents":
            version = parse_qs(urlsplit(self.path).query).get("api-version")
            if self.headers.get("Metadata") != "true" or version != ["2020-07-01"]:
                return self._answer(400)
            return self._answer(200, state.azure_events)
        self._answer(404)

    def _aws(self, path: str) -> None:
        state = self.server.state
        if not state.aws_token or self.headers.get("X-aws-ec2-metadata-token") != state.aws_token:
            return self._answer(401)
        rebalance = state.aws_rebalance
        if path.endswith("/rebalance") and state.rebalance_script:
            rebalance = state.rebalance_script.pop(0)
        bodies = {
            "/latest/meta-data/spot/instance-action": state.aws_action,
            "/latest/meta-data/events/recommendations/rebalance": rebalance,
        }
        body = bodies.get(path)
        self._answer(200, body) if body is not None else self._answer(404)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    state: FakeMetadata

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that timed out is expected here


@contextlib.contextmanager
def serving() -> Iterator[FakeMetadata]:
    """Run a fake metadata service until the block ends."""
    server = _Server(("127.0.0.1", 0), _Handler)
    state = FakeMetadata(url=f"http://127.0.0.1:{server.server_address[1]}")
    server.state = state
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        state.release.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


DMI_EVIDENCE = {
    "aws": {"sys_vendor": "Amazon EC2", "product_name": "m5.large"},
    "gcp": {"sys_vendor": "Google", "product_name": "Google Compute Engine"},
    "azure": {"sys_vendor": "Microsoft Corporation", "chassis_asset_tag": "7783-7084-3265-9085-8269-3286-77"},
}


def fake_dmi(directory: Path, cloud: str) -> str:
    """Write ``cloud``'s DMI files into ``directory`` (as ``/sys/class/dmi/id`` shows them); return it."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, value in DMI_EVIDENCE[cloud].items():
        (directory / name).write_text(value + "\n")
    return str(directory)
