"""kill -9 during background uploads to ``s3://`` (moto server on 127.0.0.1): "last" is always whole.

A child saves ``last.ckpt`` to S3 in a loop through the async IO, each file large enough for a
multi-part upload, and logs when each upload begins and ends; the parent SIGKILLs it at random moments,
then loads the object in a fresh IO (every checksum verified) and checks nothing else appeared under
the directory: no partial object, no temporary.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import fsspec
import pytest
import torch

from lightning_resume import SafetensorsCheckpointIO
from tests.helpers.kill_writes import durable_steps, kill_during_writes
from tests.helpers.s3 import s3_env

EXTENDED = frozenset(
    {
        "test_sigkill_during_background_uploads_leaves_last_whole",
    }
)
"""In make test-all only: make test kills uploads mid-way in test_s3_multipart (the previous object stays whole) and test_retention_mirror, and an async run on S3 in test_s3_resume."""

N = 14_000_000  # 56 MB: past s3fs's 50 MB block, so each upload is multi-part


@pytest.mark.timeout(600)
def test_sigkill_during_background_uploads_leaves_last_whole(tmp_path: Path, s3_bucket: str, s3_server) -> None:
    rng, mid_upload = random.Random(), 0
    for i in range(3):
        out = tmp_path / f"run{i}"
        out.mkdir()
        url = f"{s3_bucket}/run{i}/last.ckpt"
        delay = rng.uniform(0.0, 1.0)
        mid_upload += kill_during_writes(out, url, N, delay, timeout=120, env=s3_env(s3_server.endpoint)) == "begin"
        _settled(url)
        loaded = SafetensorsCheckpointIO().load_checkpoint(url)  # verifies every checksum
        step = loaded["step"]
        assert step >= durable_steps(out)[-1]
        assert torch.equal(loaded["w"], torch.full((N,), float(step))) and loaded["tag"] == [step, str(step)]
        fs = fsspec.filesystem("s3")
        fs.invalidate_cache()
        assert [p.rsplit("/", 1)[-1] for p in fs.ls(url.rsplit("/", 1)[0][len("s3://") :])] == ["last.ckpt"]
    assert mid_upload >= 1, "no kill landed during an upload"


def _settled(url: str, quiet_s: float = 0.5, timeout: float = 120.0) -> None:
    """Wait until the object's ETag holds still: the test server may still be finishing a request the killed
    writer sent, and moto (unlike S3) can serve the old object's bytes while it replaces them."""
    fs = fsspec.filesystem("s3")
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        fs.invalidate_cache()
        etag = fs.info(url[len("s3://") :]).get("ETag")
        if etag == last:
            return
        last = etag
        time.sleep(quiet_s)
