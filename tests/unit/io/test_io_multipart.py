"""Parallel multi-part uploads (``storage.multipart``): the object is the segments' bytes, whole, or nothing.

An in-memory ``MultipartClient`` records what each request carried (concurrency, order, retries, aborts);
the same code path against a moto S3 server on 127.0.0.1 checks a real save, a part retried once after a
transient failure and a permanent failure that aborts, names the URL and the part's bytes and keeps the
previous checkpoint. SIGKILL mid-upload: tests/integration/test_s3_multipart.py.
"""

from __future__ import annotations

import errno
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import fsspec
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_resume.errors import ConfigurationError
from lightning_resume.format import write
from lightning_resume.io.options import RemoteOptions
from lightning_resume.io.plugin import SafetensorsCheckpointIO
from lightning_resume.storage import files as storage
from lightning_resume.storage import multipart
from lightning_resume.storage.multipart import MAX_PARTS, MIN_PART_SIZE, Segment, UploadOptions, part_ranges

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


class MemoryStore:
    """A ``MultipartClient`` for one key: parts held per upload, the object only at ``complete``."""

    def __init__(self, fail: Optional[Dict[int, List[BaseException]]] = None, delay: float = 0.0) -> None:
        self.fail = fail or {}
        self.delay = delay
        self.object: Optional[bytes] = None
        self.parts: Dict[int, bytes] = {}
        self.calls: List[int] = []
        self.aborted: List[str] = []
        self.in_flight, self.most_in_flight = 0, 0
        self._lock = threading.Lock()

    def begin(self) -> str:
        return "upload-1"

    def put_part(self, upload_id: str, number: int, body: bytearray) -> str:
        with self._lock:
            self.calls.append(number)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.delay:
                time.sleep(self.delay)
            if self.fail.get(number):
                raise self.fail[number].pop(0)
            self.parts[number] = bytes(body)
            return f"etag-{number}"
        finally:
            with self._lock:
                self.in_flight -= 1

    def complete(self, upload_id: str, etags: Sequence[Tuple[int, str]]) -> None:
        assert [n for n, _ in etags] == sorted(self.parts) == list(range(1, len(etags) + 1))
        self.object = b"".join(self.parts[n] for n, _ in etags)

    def abort(self, upload_id: str) -> None:
        self.aborted.append(upload_id)
        self.parts.clear()

    def put_whole(self, body: bytearray) -> None:
        self.object = bytes(body)


def _segments(payload: bytes, cuts: Sequence[int]) -> List[Segment]:
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(payload)), len(payload)]
    pieces = [memoryview(payload)[a:b] for a, b in zip(bounds, bounds[1:])]
    return [Segment(len(p), lambda p=p: p) for p in pieces]


OPTIONS = UploadOptions(part_size=MIN_PART_SIZE, concurrency=3)


@given(total=st.integers(0, 3 * MAX_PARTS * MIN_PART_SIZE), part=st.integers(MIN_PART_SIZE, 64 * MiB))
def test_parts_tile_the_object_within_the_limits_of_s3(total: int, part: int) -> None:
    ranges = part_ranges(total, UploadOptions(part_size=part))
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a == b0 for (_, a), (b0, _) in zip(ranges, ranges[1:]))  # back to back, no gap or overlap
    assert len(ranges) <= MAX_PARTS
    assert all(b - a >= min(part, total) for a, b in ranges[:-1])  # every part but the last at least part_size


def test_the_object_is_the_segments_bytes_with_bounded_concurrency_and_part_one_last() -> None:
    payload = bytes(range(256)) * (14 * MiB // 256 + 7)  # 3 parts, the last short
    store = MemoryStore(delay=0.02)
    multipart.upload("s3://b/k.ckpt", store, _segments(payload, [9, 5 * MiB + 3, 11 * MiB]), OPTIONS)
    assert store.object == payload
    assert store.calls[-1] == 1 and sorted(store.calls) == [1, 2, 3]
    assert 1 < store.most_in_flight <= OPTIONS.concurrency


def test_a_small_object_is_one_request() -> None:
    store = MemoryStore()
    multipart.upload("s3://b/k.ckpt", store, _segments(b"header" + b"x" * 1000, [6]), OPTIONS)
    assert store.object == b"header" + b"x" * 1000 and store.calls == []


def test_a_transient_part_failure_is_retried_once_and_the_upload_completes(monkeypatch) -> None:
    monkeypatch.setattr(storage, "RETRY_BASE_S", 0.0)
    payload = b"y" * (12 * MiB)
    store = MemoryStore(fail={2: [ConnectionResetError(errno.ECONNRESET, "reset by peer")]})
    multipart.upload("s3://b/k.ckpt", store, _segments(payload, []), OPTIONS)
    assert store.object == payload
    assert store.calls.count(2) == 2 and store.calls.count(1) == store.calls.count(3) == 1
    assert store.aborted == []


def test_a_permanent_part_failure_aborts_names_the_url_and_the_bytes_and_sends_no_more_parts(monkeypatch) -> None:
    slept: list = []
    monkeypatch.setattr(storage.time, "sleep", slept.append)
    payload = b"z" * (40 * MiB)  # 8 parts, one at a time: part 2 fails first
    store = MemoryStore(fail={2: [PermissionError(errno.EACCES, "Access Denied")]})
    with pytest.raises(PermissionError) as caught:
        multipart.upload("s3://b/run/k.ckpt", store, _segments(payload, []), UploadOptions(MIN_PART_SIZE, 1))
    message = str(caught.value)
    assert "s3://b/run/k.ckpt" in message
    assert f"part 2 (bytes {MIN_PART_SIZE}-{2 * MIN_PART_SIZE - 1})" in message and "Access Denied" in message
    assert store.object is None and store.aborted == ["upload-1"]
    assert store.calls == [2] and slept == []  # not retried; parts 3.. never sent


def test_a_segment_that_fails_to_be_ready_aborts_the_upload_with_its_own_error() -> None:
    class Aborted(Exception):
        pass

    def never() -> memoryview:
        raise Aborted("staging aborted")

    store = MemoryStore()
    segments = [Segment(6 * MiB, lambda: memoryview(b"a" * (6 * MiB))), Segment(6 * MiB, never)]
    with pytest.raises(Aborted):
        multipart.upload("s3://b/k.ckpt", store, segments, OPTIONS)
    assert store.object is None and store.aborted == ["upload-1"]


def test_upload_options_are_checked_at_construction_naming_every_problem() -> None:
    with pytest.raises(ConfigurationError) as caught:
        UploadOptions(part_size=1 << 20, concurrency=0)
    assert "part_size=1048576" in str(caught.value) and "concurrency=0" in str(caught.value)
    assert UploadOptions(part_size=8 * MiB, concurrency=4).held_bytes == 32 * MiB


def test_only_s3fs_gets_the_multipart_path() -> None:
    assert multipart.client_for(fsspec.filesystem("memory"), "/b/k") is None


# ------------------------------------------------------------------------------- on a moto S3 server


def _state(step: int, numel: int = 4_000_000) -> dict:  # 16 MB: four 5 MiB parts
    return {"state_dict": {"w": torch.full((numel,), float(step))}, "global_step": step}


def _uploads(url: str) -> list:
    fs, key = fsspec.core.url_to_fs(url)
    return fs.list_multipart_uploads(key.split("/")[0])


SMALL_PARTS = UploadOptions(part_size=MIN_PART_SIZE, concurrency=4)


def _recording(monkeypatch, fail: Optional[Dict[int, List[BaseException]]] = None) -> list:
    """Record each part request ``(number, bytes)`` on the real client; raise ``fail[number]``'s errors first."""
    parts: list = []
    real = multipart.S3Multipart.put_part

    def put_part(self, upload_id: str, number: int, body: bytearray) -> str:
        parts.append((number, len(body)))
        if fail and fail.get(number):
            raise fail[number].pop(0)
        return real(self, upload_id, number, body)

    monkeypatch.setattr(multipart.S3Multipart, "put_part", put_part)
    return parts


def _load(url: str) -> dict:
    return SafetensorsCheckpointIO().load_checkpoint(url)


def test_a_save_to_s3_goes_up_in_parallel_parts_and_loads_bitwise(s3_bucket: str, monkeypatch) -> None:
    parts = _recording(monkeypatch)
    url = f"{s3_bucket}/run/step=1.ckpt"
    write.save_file(_state(1), url, upload=SMALL_PARTS)
    assert sorted(n for n, _ in parts) == [1, 2, 3, 4] and parts[-1][0] == 1  # the header's part last
    assert sum(n for _, n in parts) == storage.size(url)
    assert torch.equal(_load(url)["state_dict"]["w"], _state(1)["state_dict"]["w"])
    assert _uploads(url) == []


def test_an_injected_part_failure_on_s3_is_retried_once(s3_bucket: str, monkeypatch) -> None:
    monkeypatch.setattr(storage, "RETRY_BASE_S", 0.0)
    parts = _recording(monkeypatch, fail={3: [ConnectionResetError(errno.ECONNRESET, "reset by peer")]})
    url = f"{s3_bucket}/run/step=2.ckpt"
    write.save_file(_state(2), url, upload=SMALL_PARTS)
    assert [n for n, _ in parts].count(3) == 2 and len(parts) == 5
    assert _load(url)["global_step"] == 2 and _uploads(url) == []


def test_a_permanent_part_failure_on_s3_aborts_names_the_url_and_keeps_the_previous(
    s3_bucket: str, monkeypatch
) -> None:
    url = f"{s3_bucket}/run/last.ckpt"
    write.save_file(_state(3), url, upload=SMALL_PARTS)
    _recording(monkeypatch, fail={2: [PermissionError(errno.EACCES, "Access Denied")]})
    with pytest.raises(
        PermissionError, match=r"could not upload part 2 \(bytes 5242880-10485759\) of s3://.*/run/last.ckpt"
    ):
        write.save_file(_state(4), url, upload=SMALL_PARTS)
    assert _load(url)["global_step"] == 3  # the previous object, whole
    assert _uploads(url) == []  # aborted: no incomplete upload left behind
    assert [e.name for e in storage.list_dir(f"{s3_bucket}/run")] == ["last.ckpt"]


def _parts_of(url: str) -> int:
    """How many parts the object was uploaded in: S3's ETag of a multi-part object ends with ``-N``."""
    fs, key = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    etag = str(fs.info(key)["ETag"]).strip('"')
    return int(etag.rsplit("-", 1)[1]) if "-" in etag else 1


@pytest.mark.parametrize("mode", ["sync", "thread", "process"])
def test_the_plugin_options_set_the_part_size_in_every_writer(s3_bucket: str, mode: str) -> None:
    """``remote.upload_part_size`` reaches the upload on the training thread, the writer thread and the writer
    process: 16 MB in 5 MiB parts is 4 parts; the default 16 MiB part makes it 1 (one PUT)."""
    kwargs: dict = {} if mode == "sync" else {"save": "async", "writer": mode}
    remote = RemoteOptions(upload_part_size=MIN_PART_SIZE, upload_concurrency=2)
    small = SafetensorsCheckpointIO(remote=remote, **kwargs)
    default = SafetensorsCheckpointIO(**kwargs)
    try:
        for io, name in ((small, "small"), (default, "default")):
            io.save_checkpoint(_state(3), f"{s3_bucket}/{mode}/{name}.ckpt")
            io.wait()
    finally:
        small.teardown()
        default.teardown()
    assert _parts_of(f"{s3_bucket}/{mode}/small.ckpt") == 4
    assert _parts_of(f"{s3_bucket}/{mode}/default.ckpt") == 1
    assert torch.equal(_load(f"{s3_bucket}/{mode}/small.ckpt")["state_dict"]["w"], _state(3)["state_dict"]["w"])


def test_the_plugin_names_bad_upload_options() -> None:
    with pytest.raises(ConfigurationError) as err:
        RemoteOptions(upload_part_size=1024, upload_concurrency=0)
    assert "upload_part_size=1024 must be an int >= 5242880" in str(err.value)
    assert "upload_concurrency=0 must be an int >= 1" in str(err.value)
