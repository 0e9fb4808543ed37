"""An S3 server for tests: moto's ``ThreadedMotoServer`` on 127.0.0.1 at a free port, no network.

``s3_server`` (session) starts it once; ``s3_bucket`` (function) creates a fresh bucket and returns
``s3://<bucket>``. The endpoint reaches s3fs through ``AWS_ENDPOINT_URL_S3`` (botocore.s
own configuration mechanism), so code under test and child processes open plain ``s3://`` URLs.
``faults`` makes the server answer a number of requests with HTTP 500 (fault injection); ``traffic``
counts the bytes it sends for GET requests (what a client read).
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from typing import Iterator, TypeVar

import fsspec
import pytest

from tests.helpers.paths import free_port

W = TypeVar("W")

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def s3_env(endpoint: str) -> dict:
    """Environment variables that point s3fs (in this process or a child) at ``endpoint``."""
    return {**CREDENTIALS, "AWS_ENDPOINT_URL_S3": endpoint}


class Faults:
    """Fail the next ``n`` requests whose method is in ``methods`` with HTTP 500 (a WSGI middleware)."""

    def __init__(self) -> None:
        self.remaining = 0
        self.methods: frozenset = frozenset()
        self.seen = 0

    def fail(self, n: int, methods: tuple = ("PUT", "POST")) -> None:
        self.remaining, self.methods, self.seen = n, frozenset(methods), 0

    def wrap(self, app):
        def middleware(environ, start_response):
            if self.remaining > 0 and environ.get("REQUEST_METHOD") in self.methods:
                self.remaining -= 1
                self.seen += 1
                start_response("500 Internal Server Error", [("Content-Type", "application/xml")])
                body = b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
                return [body]
            return app(environ, start_response)

        return middleware


class Traffic:
    """Bytes the server sent in answer to GET requests (object reads and listings), counted as they leave."""

    def __init__(self) -> None:
        self.get_bytes = 0

    def wrap(self, app):
        def middleware(environ, start_response):
            body = app(environ, start_response)
            return self._counted(body) if environ.get("REQUEST_METHOD") == "GET" else body

        return middleware

    def _counted(self, body):
        try:
            for chunk in body:
                self.get_bytes += len(chunk)
                yield chunk
        finally:
            if hasattr(body, "close"):
                body.close()


class S3Server:
    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.faults = Faults()
        self.traffic = Traffic()
        moto_server = pytest.importorskip("moto.server")
        pytest.importorskip("s3fs")
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self._server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)

    def start(self) -> None:
        self._server.start()
        wsgi = self._server._server  # werkzeug server: wrap its app for fault injection
        wsgi.app = self.traffic.wrap(self.faults.wrap(wsgi.app))

    def stop(self) -> None:
        self._server.stop()

    @contextlib.contextmanager
    def watched(self, watcher: W) -> Iterator[W]:
        """``watcher`` (anything with ``wrap(app) -> app``, a WSGI middleware that counts what it sees) in front of
        the server while the block runs; the server as it was after."""
        wsgi = self._server._server  # the werkzeug server under moto's ThreadedMotoServer
        app = wsgi.app
        wsgi.app = watcher.wrap(app)
        try:
            yield watcher
        finally:
            wsgi.app = app


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    saved = {k: os.environ.get(k) for k in s3_env(server.endpoint)}
    os.environ.update(s3_env(server.endpoint))
    server.start()
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[str]:
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    fsspec.filesystem("s3").invalidate_cache()
    s3_server.faults.fail(0)
    yield f"s3://{bucket}"
    s3_server.faults.fail(0)
