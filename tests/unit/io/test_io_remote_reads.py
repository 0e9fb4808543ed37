"""Issue 41 item 6: remote reads end by one deadline and take only the range they asked for.

Servers on 127.0.0.1 only: moto (``tests/helpers/s3.py``) with a WSGI middleware in front of it that hangs a
ranged GET it accepted, ignores ``Range``, or cuts a body short. The deadline's arithmetic across retries is
checked with an injected clock; the hung server with a tiny deadline (the test asserts the error, never a time).
"""

from __future__ import annotations

import threading
import tracemalloc
from typing import Callable, Iterator

import pytest
import torch

from lightning_resume.errors import ConfigurationError, RangeMismatchError, RemoteReadTimeoutError
from lightning_resume.io.options import RemoteOptions
from lightning_resume.io.plugin import SafetensorsCheckpointIO
from lightning_resume.storage import files as storage
from lightning_resume.storage import ranged_get
from lightning_resume.storage.deadline import Deadline

pytestmark = pytest.mark.timeout(120)


def _state(step: int = 3) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"state_dict": {"w": torch.randn(64, 256, generator=g)}, "global_step": step}  # 64 KiB of data


def _range_start(environ: dict) -> int:
    text = environ.get("HTTP_RANGE", "")
    return int(text[len("bytes=") :].split("-")[0]) if text.startswith("bytes=") else -1


@pytest.fixture
def in_front(s3_server) -> Iterator[Callable]:
    """Put a middleware in front of moto for one test: ``in_front(lambda app: middleware)``."""
    wsgi = s3_server._server._server
    app = wsgi.app
    yield lambda wrap: setattr(wsgi, "app", wrap(app))
    wsgi.app = app


# ---------------------------------------------------------------------------------------------- deadline


def test_retries_stop_at_the_deadline_not_after_every_attempt() -> None:
    """Each try ends like a botocore read timeout, 15 s on the (injected) clock: a 20 s deadline allows two."""
    now = [0.0]
    deadline = Deadline.after(20.0, clock=lambda: now[0])
    tries: list = []

    def hung() -> bytes:
        tries.append(now[0])
        now[0] += 15.0
        raise ConnectionResetError("read timeout")

    def sleep(seconds: float) -> None:
        now[0] += seconds

    with pytest.raises(RemoteReadTimeoutError) as caught:
        storage.with_retries(hung, "s3://b/run/step=1.ckpt", "read", sleep=sleep, deadline=deadline)
    assert tries == [0.0, 15.25]  # not RETRY_ATTEMPTS of them
    message = str(caught.value)
    for part in ("s3://b/run/step=1.ckpt", "20 s", "read_deadline", "RemoteOptions(read_deadline="):
        assert part in message, part
    assert isinstance(caught.value.__cause__, ConnectionResetError)


def test_a_ranged_get_accepted_and_never_answered_ends_the_load_at_its_deadline(
    s3_bucket: str, in_front, monkeypatch
) -> None:
    """Every ranged GET past the head hangs (accepted, never answered): s3fs's 15 s read timeout and the
    retries of three layers would keep the load ~38 min; the load's deadline ends it, naming URL and deadline."""
    monkeypatch.setattr(storage, "READ_CHUNK", 4096)
    url = f"{s3_bucket}/run/step=3.ckpt"
    SafetensorsCheckpointIO().save_checkpoint(_state(), url)
    release, hung = threading.Event(), []

    def hang(app):
        def middleware(environ, start_response):
            if environ.get("REQUEST_METHOD") == "GET" and _range_start(environ) > 0:
                hung.append(environ["HTTP_RANGE"])
                release.wait(300)  # until the test ends
            return app(environ, start_response)

        return middleware

    in_front(hang)
    try:
        with pytest.raises(RemoteReadTimeoutError) as caught:
            SafetensorsCheckpointIO(remote=RemoteOptions(read_deadline=2)).load_checkpoint(url)
    finally:
        release.set()
    message = str(caught.value)
    assert url in message and "2 s" in message and "read_deadline" in message, message
    assert hung  # the GETs were accepted and held


def test_the_deadline_is_validated_at_construction() -> None:
    for bad in (0, -1, "soon", float("nan"), float("inf"), True):
        with pytest.raises(ConfigurationError, match="read_deadline="):
            RemoteOptions(read_deadline=bad)  # type: ignore[arg-type]
    assert RemoteOptions().read_deadline_s == 600.0
    assert RemoteOptions(read_deadline="30min").read_deadline_s == 1800.0


# --------------------------------------------------------------------------------------- the range asked


def _ignore_range(app):
    def middleware(environ, start_response):
        environ.pop("HTTP_RANGE", None)  # a server (or proxy) that answers every GET with the whole object
        return app(environ, start_response)

    return middleware


def test_a_server_that_ignores_range_is_refused_naming_the_url_and_range(s3_bucket: str, in_front) -> None:
    url = f"{s3_bucket}/run/step=3.ckpt"
    SafetensorsCheckpointIO().save_checkpoint(_state(), url)
    in_front(_ignore_range)
    with pytest.raises(RangeMismatchError) as caught:
        SafetensorsCheckpointIO().load_checkpoint(url)
    message = str(caught.value)
    for part in (url, "bytes 0-8 (9 bytes)", "the whole object", "HTTP 200", "Range"):
        assert part in message, part


def test_a_whole_object_answer_is_refused_before_it_is_buffered(s3_bucket: str, in_front, monkeypatch) -> None:
    """The reader's 2 GETs are answered with a 64 MiB body each (HTTP 200, Range ignored): refused from the
    answer's headers. What the process allocated meanwhile (what the client read from the socket before the
    refusal closed it: about 10 MB measured, 20 MB under load) is a fraction of one body (before: each stream held a whole body,
    twice)."""
    size, block = 64 << 20, bytes(64 << 10)  # 2 streams of 4 MiB chunks: an 8 MiB window
    url = f"{s3_bucket}/big"

    def whole(app):
        def middleware(environ, start_response):
            if environ.get("REQUEST_METHOD") != "GET" or not environ.get("PATH_INFO", "").endswith("/big"):
                return app(environ, start_response)
            start_response("200 OK", [("Content-Length", str(size)), ("Content-Type", "binary/octet-stream")])
            return (block for _ in range(size // len(block)))

        return middleware

    in_front(whole)
    reader = storage.RangedReader(url, size)
    assert reader.streams > 1
    assert not storage.exists(url)  # the client is built (botocore's models loaded) before counting
    tracemalloc.start()
    try:
        with pytest.raises(RangeMismatchError, match="the whole object"):
            reader.read(100)
        reader.close()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # about 10 MB on a quiet machine, 20 MB seen under load (the client reads on while the refusal is raised): far
    # below one whole body, let alone the two the streams held before
    assert peak < size // 2, f"{peak} bytes allocated"


def test_a_short_body_is_retried_then_refused_naming_the_range(s3_bucket: str, in_front, monkeypatch) -> None:
    """Every ranged GET past the head answers half its range, with headers that agree: retried, then refused
    naming the URL and the range (before: a short chunk read as the end of the file)."""
    monkeypatch.setattr(storage, "READ_CHUNK", 4096)
    monkeypatch.setattr(storage, "RETRY_BASE_S", 0.0)
    url = f"{s3_bucket}/run/step=3.ckpt"
    SafetensorsCheckpointIO().save_checkpoint(_state(), url)
    cut: list = []

    def halve(app):
        def middleware(environ, start_response):
            if environ.get("REQUEST_METHOD") != "GET" or _range_start(environ) <= 0:
                return app(environ, start_response)
            answer: dict = {}
            body = b"".join(app(environ, lambda status, headers, *_: answer.update(status=status, headers=headers)))
            first, last, total = _content_range(answer["headers"])
            half = body[: len(body) // 2]
            headers = [(k, v) for k, v in answer["headers"] if k.lower() not in ("content-length", "content-range")]
            headers += [
                ("Content-Length", str(len(half))),
                ("Content-Range", f"bytes {first}-{first + len(half) - 1}/{total}"),
            ]
            cut.append(first)
            start_response(answer["status"], headers)
            return [half]

        return middleware

    in_front(halve)
    with pytest.raises(RangeMismatchError) as caught:
        SafetensorsCheckpointIO(fallback_to_verified=False).load_checkpoint(url)
    message = str(caught.value)
    assert url in message and "a ranged GET of bytes 4096-8191 (4096 bytes)" in message, message
    assert "Content-Length of 2048" in message and caught.value.transient
    assert cut.count(4096) == storage.RETRY_ATTEMPTS  # retried as a cut transfer, then refused


def _content_range(headers: list) -> tuple:
    value = next(v for k, v in headers if k.lower() == "content-range")
    span, total = value.split(" ")[1].split("/")
    first, last = span.split("-")
    return int(first), int(last), int(total)


def test_what_an_answer_must_carry_follows_from_its_headers() -> None:
    expected = ranged_get.expected_length
    assert expected("u", 0, 9, 206, "bytes 0-8/100", 9) == 9
    assert expected("u", 90, 200, 206, "bytes 90-99/100", 10) == 10  # the object ends inside the range
    assert expected("u", 0, 9, 200, None, 5) == 5  # Range ignored, but the whole object is the range
    assert expected("u", 0, 9, 206, None, None) == 9
    for status, content_range, length in ((200, None, 100), (206, "bytes 5-13/100", 9), (206, "bytes 0-8/100", 50)):
        with pytest.raises(RangeMismatchError) as caught:
            expected("u", 0, 9, status, content_range, length)
        assert not caught.value.transient
    with pytest.raises(RangeMismatchError) as caught:
        expected("u", 0, 9, 206, "bytes 0-8/100", 4)
    assert caught.value.transient and caught.value.errno is not None and storage.is_transient(caught.value)
