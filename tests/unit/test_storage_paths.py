"""URL handling and error classification of ``storage`` (pure: no server)."""

from __future__ import annotations

import errno
import os

import pytest

from lightning_resume.storage import files as storage


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


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path) -> str:
    """The same operations on a local directory and on fsspec's in-memory filesystem (a URL)."""
    if request.param == "local":
        return str(tmp_path)
    import uuid

    return f"memory://storage-test-{uuid.uuid4().hex[:8]}"


def _put(path: str, data: bytes) -> None:
    from lightning_resume.format.atomic import atomic_write

    atomic_write(path, lambda f: f.write(data))


def test_one_interface_for_local_paths_and_urls(root: str) -> None:
    a, b = storage.join(root, "a.bin"), storage.join(root, "b.bin")
    _put(a, b"0123456789")
    assert storage.exists(a) and not storage.exists(b) and not storage.is_dir(a)
    assert storage.size(a) == 10 and storage.size(b) is None
    assert storage.read_bytes(a) == b"0123456789" and storage.read_range(a, 2, 5) == b"234"
    assert storage.read_range(a, 8, 20) == b"89"  # shorter only at the end of the file
    assert storage.mtime(a) is not None and storage.mtime(b) is None
    _put(b, b"01")
    assert [(e.name, e.is_dir) for e in storage.list_dir(root)] == [("a.bin", False), ("b.bin", False)]
    storage.remove(a)
    assert all(e.path == storage.join(root, e.name) for e in storage.list_dir(root))
    storage.remove(b)
    storage.remove(b)  # already gone: carried out, not an error
    assert storage.list_dir(root) == [] and storage.list_dir(storage.join(root, "missing")) == []
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(b)


def test_candidates_is_the_one_rule_for_what_a_directory_holds(root: str) -> None:
    from lightning_resume.io.resolve import candidates, newest_first, progress

    for name in ("step=000000002.ckpt", "epoch=0-step=7.ckpt", "b.safetensors", "notes.txt", ".x.ckpt.tmp-1-0badf00d"):
        _put(storage.join(root, name), b"x")
    found = [e.name for e in candidates(root)]
    assert found == ["b.safetensors", "epoch=0-step=7.ckpt", "step=000000002.ckpt"]
    assert [e.name for e in candidates(root, (".ckpt",))] == ["epoch=0-step=7.ckpt", "step=000000002.ckpt"]
    # newest by training progress (the step in the name), whatever the clock says; no step: last
    ordered = newest_first(e.path for e in candidates(root))
    assert [storage.basename(p) for p in ordered] == ["epoch=0-step=7.ckpt", "step=000000002.ckpt", "b.safetensors"]
    assert progress(storage.join(root, "gone.ckpt")) is None
