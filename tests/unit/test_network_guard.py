"""The suite-wide network guard (tests/helpers/network.py) refuses what leaves the machine and lets
loopback through, so a test that reaches for 169.254.169.254 fails instead of connecting."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.request import urlopen

import pytest

from tests.helpers.network import ForbiddenConnection, allowed


@pytest.mark.parametrize("host", ["169.254.169.254", "10.0.0.1", "192.168.1.1", "8.8.8.8", "fd00::1", "example.com"])
def test_every_address_beyond_loopback_is_refused_before_any_packet(host: str) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s, pytest.raises(ForbiddenConnection, match=host):
        s.connect((host, 80))
    assert not allowed((host, 80))


def test_loopback_passes() -> None:
    class Hello(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"hi")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert urlopen(f"http://127.0.0.1:{server.server_port}/", timeout=5).read() == b"hi"
    finally:
        server.shutdown()
        server.server_close()
    assert allowed(("localhost", 1)) and allowed(("::1", 1, 0, 0)) and allowed("/tmp/socket")
