"""The guard that keeps the test suite off every network but this machine's loopback.

Tests start their own servers on 127.0.0.1 (an S3-compatible server, HTTP servers that speak the cloud
metadata APIs); nothing may reach the cloud metadata address 169.254.169.254, a private range or the
internet, even by mistake (a default endpoint left in place, a proxy from the environment). Every
``socket.connect``/``connect_ex`` of the test process is checked: loopback addresses, ``localhost`` and
Unix sockets pass; anything else raises ``ForbiddenConnection`` naming the address. Processes the tests
start are their own; what they connect to is theirs to test (they are pointed at 127.0.0.1).
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any, Callable

ALLOWED_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


class ForbiddenConnection(ConnectionRefusedError):
    """A test tried to connect beyond the loopback interface."""


def allowed(address: Any) -> bool:
    """Whether ``address`` (a ``connect`` argument) stays on this machine."""
    if not isinstance(address, tuple) or not address:
        return True  # AF_UNIX paths (str or bytes) and other local families
    host = str(address[0]).split("%", 1)[0]
    if host.lower() in ALLOWED_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost: resolving it could already leave the machine


def _guarded(connect: Callable[..., Any]) -> Callable[..., Any]:
    def guarded(self: socket.socket, address: Any) -> Any:
        if self.family in (socket.AF_INET, socket.AF_INET6) and not allowed(address):
            raise ForbiddenConnection(f"tests may only connect to 127.0.0.1/::1, not {address!r}")
        return connect(self, address)

    return guarded


def install() -> Callable[[], None]:
    """Guard ``socket.socket.connect`` and ``connect_ex`` in this process; return what undoes it."""
    originals = socket.socket.connect, socket.socket.connect_ex
    socket.socket.connect = _guarded(originals[0])  # type: ignore[method-assign]
    socket.socket.connect_ex = _guarded(originals[1])  # type: ignore[method-assign]

    def undo() -> None:
        socket.socket.connect, socket.socket.connect_ex = originals  # type: ignore[method-assign]

    return undo
