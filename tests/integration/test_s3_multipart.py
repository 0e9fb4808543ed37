"""SIGKILL of a real process in the middle of a parallel multi-part upload to ``s3://`` (moto on 127.0.0.1).

The parent saves step 1 as ``last.ckpt``; a child saves step 2 over it through ``storage.multipart`` (5 MiB parts,
two in flight, each part slowed so the upload takes seconds) and is SIGKILLed once the server holds some of
its parts but not all. What must hold: the name still serves step 1, whole (every checksum verified), nothing
else appears under the directory, and the dead writer's incomplete upload, invisible to readers, is aborted
by the next writer's cleanup once it is old enough (``clean_stale_temporaries``), not before.
"""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest
import torch

from lightning_resume import SafetensorsCheckpointIO
from lightning_resume.format import atomic
from lightning_resume.storage import files as storage
from tests.helpers import processes
from tests.helpers.s3 import s3_env

pytestmark = pytest.mark.timeout(300)

NUMEL = 10_000_000  # 40 MB: 8 parts of 5 MiB

CHILD = """
import sys, time
import torch
from lightning_resume.storage import multipart
from lightning_resume.format import write

real = multipart.S3Multipart.put_part

def slow(self, upload_id, number, body):
    etag = real(self, upload_id, number, body)
    time.sleep(0.5)  # keeps the upload open long enough for the parent to kill it between parts
    return etag

multipart.S3Multipart.put_part = slow
state = {"w": torch.full((int(sys.argv[2]),), 2.0), "step": 2}
write.save_file(state, sys.argv[1], upload=multipart.UploadOptions(part_size=5 << 20, concurrency=2))
print("committed")
"""


def _parts_in(fs, bucket: str, key: str) -> int:
    """Parts the server holds for the first incomplete upload of ``key`` (0 if none is open)."""
    uploads = [u for u in fs.list_multipart_uploads(bucket) if u["Key"] == key]
    if not uploads:
        return 0
    listed = fs.call_s3("list_parts", Bucket=bucket, Key=key, UploadId=uploads[0]["UploadId"])
    return len(listed.get("Parts", []))


def test_sigkill_mid_multipart_upload_leaves_the_previous_object_and_no_partial_one(
    tmp_path: Path, s3_bucket: str, s3_server
) -> None:
    url = f"{s3_bucket}/run/last.ckpt"
    SafetensorsCheckpointIO().save_checkpoint({"w": torch.full((NUMEL,), 1.0), "step": 1}, url)
    fs, path = fsspec.core.url_to_fs(url)
    bucket, key = path.split("/", 1)
    script = tmp_path / "upload_child.py"
    script.write_text(CHILD)
    child = processes.start([script, url, NUMEL], env=s3_env(s3_server.endpoint))
    processes.kill_when(child, lambda: 2 <= _parts_in(fs, bucket, key) < 8, timeout=120)
    assert "committed" not in processes.output(child)

    loaded = SafetensorsCheckpointIO().load_checkpoint(url)  # every checksum verified
    assert loaded["step"] == 1 and torch.equal(loaded["w"], torch.full((NUMEL,), 1.0))
    assert [e.name for e in storage.list_dir(f"{s3_bucket}/run")] == ["last.ckpt"]
    (left,) = fs.list_multipart_uploads(bucket)  # the dead writer's parts: invisible, but still held
    started = left["Initiated"].timestamp()  # moto reports a fixed date: the clock is taken relative to it
    assert atomic.clean_stale_temporaries(f"{s3_bucket}/run", now=started + 60) == []  # could be a live writer
    removed = atomic.clean_stale_temporaries(f"{s3_bucket}/run", now=started + 2 * atomic.STALE_AFTER_S)
    assert removed == [f"{url} (incomplete upload)"]
    assert fs.list_multipart_uploads(bucket) == []
    assert SafetensorsCheckpointIO().load_checkpoint(url)["step"] == 1
