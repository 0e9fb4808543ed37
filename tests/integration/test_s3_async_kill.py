"""kill -9 during background uploads to ``s3://`` (moto server on 127.0.0.1): "last" is always whole.

A child saves ``last.ckpt`` to S3 in a loop through the async IO, each file large enough for a
multi-part upload, and logs when each upload begins and ends; the parent SIGKILLs it at random moments,
then loads the object in a fresh IO (every checksum verified) and checks nothing else appeared under
the directory: no partial object, no temporary.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import fsspec
import pytest
import torch

from lightning_resume import SafetensorsCheckpointIO
from tests.helpers.paths import REPO_ROOT
from tests.helpers.s3 import s3_env

N = 14_000_000  # 56 MB: past s3fs's 50 MB block, so each upload is multi-part

CHILD = textwrap.dedent(
    f"""
    import os, sys, torch
    torch.set_num_threads(1)
    from lightning_resume import SafetensorsCheckpointIO
    out, url = sys.argv[1], sys.argv[2]
    log = open(os.path.join(out, "events"), "a", buffering=1)
    class Logged(SafetensorsCheckpointIO):  # each background write, logged around the plugin's hook
        def _commit(self, path, tree_json, tensors):
            log.write(f"begin {{int(tensors['w'][0])}}\\n")
            super()._commit(path, tree_json, tensors)
            log.write(f"end {{int(tensors['w'][0])}}\\n")
    io = Logged(async_save=True)
    w = torch.zeros({N})
    for step in range(1, 100_000):
        w.fill_(step)
        io.save_checkpoint({{"w": w, "step": step}}, url)
    """
)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _kill_during_uploads(out: Path, url: str, env: dict, delay: float) -> str:
    child_env = {**os.environ, **env, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(out), url], cwd=REPO_ROOT, env=child_env)
    try:
        deadline = time.monotonic() + 120
        while "end" not in _read(out / "events") and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        assert proc.poll() is None and "end" in _read(out / "events"), "the child never completed an upload"
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return _read(out / "events").split()[-2]


@pytest.mark.timeout(600)
def test_sigkill_during_background_uploads_leaves_last_whole(tmp_path: Path, s3_bucket: str, s3_server) -> None:
    rng, mid_upload = random.Random(), 0
    for i in range(3):
        out = tmp_path / f"run{i}"
        out.mkdir()
        url = f"{s3_bucket}/run{i}/last.ckpt"
        mid_upload += _kill_during_uploads(out, url, s3_env(s3_server.endpoint), rng.uniform(0.0, 1.0)) == "begin"
        durable = [int(line.split()[1]) for line in _read(out / "events").splitlines() if line.startswith("end")]
        loaded = SafetensorsCheckpointIO().load_checkpoint(url)  # verifies every checksum
        assert loaded["step"] >= durable[-1]
        assert torch.equal(loaded["w"], torch.full((N,), float(loaded["step"])))
        fs = fsspec.filesystem("s3")
        fs.invalidate_cache()
        assert [p.rsplit("/", 1)[-1] for p in fs.ls(url.rsplit("/", 1)[0][len("s3://") :])] == ["last.ckpt"]
    assert mid_upload >= 1, "no kill landed during an upload"
