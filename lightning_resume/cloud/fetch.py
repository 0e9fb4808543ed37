"""One HTTP request to a metadata service, with a deadline on the whole answer.

``fetch`` connects, sends, and reads the status line, the headers and up to ``limit`` bytes of body, all
before one deadline: a server that drips its answer a byte at a time is cut when the deadline passes, not
when a single read waits too long (a per-read timeout never fires on a drip). The deadline is kept by the
socket itself: every read is given only the time left (``_DeadlineSocket``), and connect and the TLS
handshake get the time left when they start. No thread is involved and nothing is retried here.

What it must not do: follow a redirect (a 3xx is returned as an answer, and the parser refuses it), use
the environment's proxies (``http.client`` never reads them), or send a header value that is not printable
ASCII (``HeaderValueError``; values are sent as ASCII bytes, so nothing is encoded behind our back).
"""

from __future__ import annotations

import http.client
import io
import socket
import time
from typing import Any, Iterable
from urllib.parse import urlsplit

from lightning_resume.cloud.protocols import header_value_problem


class HeaderValueError(ValueError):
    """A header value we refuse to send (``protocols.header_value_problem`` says why)."""


def _encoded(headers: Iterable[tuple[str, str]]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for name, value in headers:
        problem = header_value_problem(value)
        if problem is not None:
            raise HeaderValueError(f"header {name!r} refused: {problem}")
        out[name] = value.encode("ascii")
    return out


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        """The time left; ``TimeoutError`` once there is none."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"timed out: no whole answer within {self.seconds:g}s")
        return left


class _DeadlineSocket:
    """What ``http.client.HTTPResponse`` reads from: a buffered file whose every read is given the time left."""

    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        self._sock, self._deadline = sock, deadline

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))


class _DeadlineReader(io.RawIOBase):
    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._sock.settimeout(self._deadline.left())
        return self._sock.recv_into(buffer)


class _Plain(http.client.HTTPConnection):
    _deadline: _Deadline

    def connect(self) -> None:
        self.timeout = self._deadline.left()
        super().connect()
        self.sock.settimeout(self._deadline.left())  # what the TLS handshake (``_TLS``) may take

    def deadline_response(self, method: str) -> http.client.HTTPResponse:
        return http.client.HTTPResponse(_DeadlineSocket(self.sock, self._deadline), method=method)  # type: ignore[arg-type]


class _TLS(http.client.HTTPSConnection, _Plain):
    """``HTTPSConnection.connect`` calls ``_Plain.connect`` (this MRO), then wraps the socket: the handshake
    runs with the time left after connecting."""


def fetch(
    url: str, method: str, headers: Iterable[tuple[str, str]], deadline_s: float, limit: int
) -> tuple[int, bytes]:
    """``(status, body)`` of ``method url``, the body read up to ``limit`` bytes, the whole within ``deadline_s``.

    ``TimeoutError`` when the deadline passes; other ``OSError``s and ``http.client.HTTPException`` as the
    connection fails; ``HeaderValueError`` (before any socket) for a header value ``header_value_problem`` refuses.
    """
    values = _encoded(headers)
    parts = urlsplit(url)
    path = parts.path + (f"?{parts.query}" if parts.query else "") or "/"
    deadline = _Deadline(deadline_s)
    kind = _TLS if parts.scheme == "https" else _Plain
    conn = kind(parts.hostname or "", parts.port)
    conn._deadline = deadline
    try:
        conn.request(method, path, headers=values)  # bytes values are sent as they are
        response = conn.deadline_response(method)
        response.begin()
        with response:
            return response.status, response.read(limit)
    finally:
        conn.close()
