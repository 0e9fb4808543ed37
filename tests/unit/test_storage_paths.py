"""URL handling and error classification of ``storage`` (pure: no server)."""

from __future__ import annotations

import errno
import os

import pytest

from lightning_resume import storage


@pytest.mark.parametrize(
    ("dirpath", "name", "joined"),
    [
        ("s3://bucket/run", "a.ckpt", "s3://bucket/run/a.ckpt"),
        ("s3://bucket/run/", "a.ckpt", "s3://bucket/run/a.ckpt"),
        ("gs://b/x", "y", "gs://b/x/y"),
        ("file:///tmp/run", "a.ckpt", "file:///tmp/run/a.ckpt"),
        ("ckpt/./run", "a.ckpt", os.path.join("ckpt", "run", "a.ckpt")),
    ],
)
def test_join_keeps_the_scheme_and_normalises_local_paths(dirpath: str, name: str, joined: str) -> None:
    assert storage.join(dirpath, name) == joined


def test_split_keeps_the_scheme() -> None:
    assert storage.split("s3://bucket/run/a.ckpt") == ("s3://bucket/run", "a.ckpt")
    assert storage.split("run/a.ckpt") == ("run", "a.ckpt")


class _ClientError(Exception):
    def __init__(self, status: int, code: str) -> None:
        super().__init__(code)
        self.response = {"ResponseMetadata": {"HTTPStatusCode": status}, "Error": {"Code": code}}


@pytest.mark.parametrize(
    ("err", "transient"),
    [
        (OSError(errno.EREMOTEIO, "500"), True),
        (ConnectionResetError(), True),
        (TimeoutError(), True),
        (_ClientError(503, "SlowDown"), True),
        (_ClientError(500, "InternalError"), True),
        (FileNotFoundError("no bucket"), False),
        (PermissionError("denied"), False),
        (_ClientError(403, "AccessDenied"), False),
        (OSError(errno.EINVAL, "bad request"), False),
    ],
)
def test_transient_errors_are_told_from_permanent_ones(err: BaseException, transient: bool) -> None:
    assert storage.is_transient(err) is transient


def test_retries_are_bounded_and_back_off_and_name_the_url() -> None:
    slept: list = []
    calls: list = []

    def always_500() -> None:
        calls.append(1)
        raise OSError(errno.EREMOTEIO, "server error")

    with pytest.raises(OSError, match=r"could not write s3://b/k after 4 tries"):
        storage.with_retries(always_500, "s3://b/k", "write", sleep=slept.append, attempts=4)
    assert len(calls) == 4 and slept == [0.25, 0.5, 1.0]


def test_a_callers_own_error_passes_through_unchanged() -> None:
    with pytest.raises(ValueError, match="unencodable"):
        storage.with_retries(lambda: (_ for _ in ()).throw(ValueError("unencodable")), "s3://b/k", "write")
