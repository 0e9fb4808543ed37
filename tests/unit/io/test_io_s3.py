"""Checkpoint files on ``s3://`` (moto server on 127.0.0.1): save, load, verify, refusal, atomicity, retries."""

from __future__ import annotations

import fsspec
import pytest
import torch

from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.format import atomic
from lightning_resume.io.plugin import SafetensorsCheckpointIO
from lightning_resume.io.verify import verify
from lightning_resume.storage import files as storage

pytestmark = pytest.mark.timeout(120)


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"state_dict": {"w": torch.randn(64, 8, generator=g), "b": torch.arange(5)}, "global_step": seed}


def test_save_load_verify_roundtrip_on_s3(s3_bucket: str) -> None:
    io = SafetensorsCheckpointIO()
    url = f"{s3_bucket}/run/step=1.ckpt"
    io.save_checkpoint(_state(1), url)
    fs, _ = fsspec.core.url_to_fs(url)
    assert fs.exists(url)
    loaded = io.load_checkpoint(url)
    assert torch.equal(loaded["state_dict"]["w"], _state(1)["state_dict"]["w"])
    assert loaded["global_step"] == 1
    verify(url)


def test_a_flipped_byte_is_refused_naming_the_url(s3_bucket: str) -> None:
    url = f"{s3_bucket}/run/step=2.ckpt"
    SafetensorsCheckpointIO().save_checkpoint(_state(2), url)
    fs, key = fsspec.core.url_to_fs(url)
    data = bytearray(fs.cat_file(key))
    data[-3] ^= 0x01
    fs.pipe_file(key, bytes(data))
    with pytest.raises(CheckpointCorruptError, match="step=2.ckpt"):
        SafetensorsCheckpointIO().load_checkpoint(url)
    with pytest.raises(CheckpointCorruptError):
        verify(url)


def test_a_failed_upload_leaves_no_object_and_the_previous_one_intact(s3_bucket: str) -> None:
    url = f"{s3_bucket}/run/model.ckpt"
    atomic.atomic_write(url, lambda f: f.write(b"old"))

    def broken(f) -> None:
        f.write(b"x" * (6 << 20))  # past one multi-part chunk: a real multi-part upload is begun
        f.flush()
        raise RuntimeError("writer died")

    with pytest.raises(RuntimeError, match="writer died"):
        atomic.atomic_write(url, broken)
    fs, key = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    assert fs.cat_file(key) == b"old"
    assert [e.name for e in storage.list_dir(f"{s3_bucket}/run")] == ["model.ckpt"]
    assert fs.list_multipart_uploads(key.split("/")[0]) == []


def test_transient_server_errors_are_retried_until_the_save_succeeds(s3_bucket: str, s3_server, monkeypatch) -> None:
    monkeypatch.setattr(storage, "RETRY_BASE_S", 0.01)
    url = f"{s3_bucket}/run/step=3.ckpt"
    s3_server.faults.fail(12)  # more than botocore's and s3fs's own retries absorb
    SafetensorsCheckpointIO().save_checkpoint(_state(3), url)
    assert s3_server.faults.seen == 12
    assert SafetensorsCheckpointIO().load_checkpoint(url)["global_step"] == 3


def test_persistent_server_errors_fail_the_save_naming_the_url_and_keep_the_previous(
    s3_bucket: str, s3_server, monkeypatch
) -> None:
    monkeypatch.setattr(storage, "RETRY_BASE_S", 0.01)
    monkeypatch.setattr(storage, "RETRY_ATTEMPTS", 2)
    url = f"{s3_bucket}/run/last.ckpt"
    SafetensorsCheckpointIO().save_checkpoint(_state(4), url)
    s3_server.faults.fail(10_000)
    with pytest.raises(OSError, match="last.ckpt"):
        SafetensorsCheckpointIO().save_checkpoint(_state(5), url)
    s3_server.faults.fail(0)
    assert SafetensorsCheckpointIO().load_checkpoint(url)["global_step"] == 4


def test_a_missing_bucket_fails_at_once_naming_the_url(s3_server, monkeypatch) -> None:
    slept: list = []
    monkeypatch.setattr(storage.time, "sleep", slept.append)
    with pytest.raises(FileNotFoundError, match="s3://no-such-bucket-here/run/a.ckpt"):
        SafetensorsCheckpointIO().save_checkpoint(_state(6), "s3://no-such-bucket-here/run/a.ckpt")
    assert slept == []


def test_stale_temporaries_of_dead_writers_are_removed_live_and_foreign_kept(s3_bucket: str) -> None:
    fs = fsspec.filesystem("s3")
    base = s3_bucket[len("s3://") :] + "/run"
    mine = atomic.owner_token()
    dead = f".a.ckpt.tmp-{mine}-999999999-0badf00d"
    live = f".b.ckpt.tmp-{mine}-{__import__('os').getpid()}-0badf00d"
    foreign = ".c.ckpt.tmp-0123456789ab-5-0badf00d"
    for name in (dead, live, foreign, "keep.ckpt"):
        fs.pipe_file(f"{base}/{name}", b"x")
    removed = atomic.clean_stale_temporaries(f"{s3_bucket}/run")
    assert removed == [f"{s3_bucket}/run/{dead}"]
    later = atomic.clean_stale_temporaries(f"{s3_bucket}/run", now=__import__("time").time() + 2 * atomic.STALE_AFTER_S)
    assert later == [f"{s3_bucket}/run/{foreign}"]
    fs.invalidate_cache()
    assert sorted(e.name for e in storage.list_dir(f"{s3_bucket}/run")) == sorted([live, "keep.ckpt"])


def test_async_save_to_s3_uploads_in_the_background_in_order(s3_bucket: str) -> None:
    io = SafetensorsCheckpointIO(save="async")
    try:
        first, second = f"{s3_bucket}/run/step=1.ckpt", f"{s3_bucket}/run/step=2.ckpt"
        io.save_checkpoint(_state(1), first)
        io.save_checkpoint(_state(2), second)  # reuses the host buffer once the first upload is done
        io.remove_checkpoint(first)  # queued behind both writes
        assert io.wait()
        names = sorted(e.name for e in storage.list_dir(f"{s3_bucket}/run"))
        assert names == ["step=2.ckpt"]
        assert torch.equal(io.load_checkpoint(second)["state_dict"]["w"], _state(2)["state_dict"]["w"])
    finally:
        io.teardown()


def test_async_save_failure_on_s3_surfaces_at_wait_naming_the_url(s3_server, monkeypatch) -> None:
    from lightning_resume.errors import AsyncWriteError

    io = SafetensorsCheckpointIO(save="async")
    url = "s3://no-such-bucket-async/run/step=1.ckpt"
    io.save_checkpoint(_state(1), url)  # returns after the snapshot; the upload fails in the background
    with pytest.raises(AsyncWriteError, match="no-such-bucket-async/run/step=1.ckpt"):
        io.wait()
    io.teardown()


def test_incomplete_uploads_of_dead_writers_are_aborted_once_a_day_old(s3_bucket: str) -> None:
    fs, key = fsspec.core.url_to_fs(f"{s3_bucket}/run/step=7.ckpt")
    f = fs.open(key, "wb", autocommit=False, block_size=5 << 20)
    f.write(b"x" * (6 << 20))
    f.flush()  # a multi-part upload begun, then its writer "dies": never completed, never aborted
    bucket = key.split("/")[0]
    (upload,) = fs.list_multipart_uploads(bucket)
    started = upload["Initiated"].timestamp()  # moto reports a fixed date: the clock is taken relative to it
    assert atomic.clean_stale_temporaries(f"{s3_bucket}/run", now=started + 60) == []  # may still be in flight
    removed = atomic.clean_stale_temporaries(f"{s3_bucket}/run", now=started + 2 * atomic.STALE_AFTER_S)
    assert removed == [f"{s3_bucket}/run/step=7.ckpt (incomplete upload)"]
    assert fs.list_multipart_uploads(bucket) == []


def test_a_ranged_get_that_fails_once_during_a_load_is_retried(s3_bucket: str, s3_server, monkeypatch) -> None:
    """One 500 on a GET of the load's ranged reads: retried, and the load is bitwise (the fault was seen)."""
    monkeypatch.setattr(storage, "RETRY_BASE_S", 0.0)
    url = f"{s3_bucket}/run/step=4.ckpt"
    SafetensorsCheckpointIO().save_checkpoint(_state(4), url)
    s3_server.faults.fail(1, methods=("GET",))
    loaded = SafetensorsCheckpointIO().load_checkpoint(url)
    assert s3_server.faults.seen == 1
    assert torch.equal(loaded["state_dict"]["w"], _state(4)["state_dict"]["w"])


def test_a_corrupt_range_is_refused_naming_the_url_and_where_in_the_object(s3_bucket: str) -> None:
    url = f"{s3_bucket}/run/step=5.ckpt"
    SafetensorsCheckpointIO().save_checkpoint(_state(5), url)
    fs, key = fsspec.core.url_to_fs(url)
    data = bytearray(fs.cat_file(key))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(key, bytes(data))
    with pytest.raises(CheckpointCorruptError) as err:
        SafetensorsCheckpointIO().load_checkpoint(url)
    message = str(err.value)
    assert url in message and "tensor 'state_dict.w' (data bytes " in message, message
