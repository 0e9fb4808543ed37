"""Kill and resume against ``s3://`` (moto server on 127.0.0.1): run A uninterrupted with local files; run B
writing to S3, SIGKILLed from outside; run C, a fresh process, ``fit(ckpt_path="last")`` from S3. C continues
A bit for bit. The child processes reach the server through ``AWS_ENDPOINT_URL_S3`` (``tests/helpers/s3.py``)."""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest

from tests.helpers import kill_resume as h
from tests.helpers.s3 import s3_env

BASE = {"n": 40, "batch_size": 4, "max_epochs": 2, "dropout": 0.2, "augment": True, "shuffle": True}


def _three_runs(tmp_path: Path, cfg: dict, remote_dir: str, env: dict, pause: int) -> dict:
    a = h.uninterrupted(cfg, tmp_path)
    b = dict(cfg, out=str(tmp_path / "B"), ckpt_dir=remote_dir, pause_before=pause, env=env)
    h.run_until_paused(b, tmp_path)
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    left = [p for p in fs.ls(remote_dir[len("s3://") :]) if ".tmp-" in p]
    assert left == [], left  # uploads commit whole or not at all: a SIGKILL leaves no temporary object
    c = h.resumed(cfg, tmp_path, remote_dir, env=env)
    return a | {"c_out": c["out"]}


def test_retention_async_on_s3_killed_and_resumed_bit_for_bit(tmp_path: Path, s3_bucket: str, s3_server) -> None:
    retention = {"retention": {"keep_last": 2}, "every_n_train_steps": 3}
    cfg = {**BASE, "retention": retention, "safetensors": True, "async": True}
    remote_dir = f"{s3_bucket}/run"
    runs = _three_runs(tmp_path, cfg, remote_dir, s3_env(s3_server.endpoint), pause=7)
    h.assert_exact_resume(runs["out"], runs["c_out"], resumed_after=6)
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(remote_dir[len("s3://") :]))
    # keep_last=2 pruned on S3: steps 9 and 12 went; step 6, the resume source, is never deleted
    assert names == ["step=000000006.ckpt", "step=000000015.ckpt", "step=000000018.ckpt"], names
    assert not (tmp_path / "s3:").exists()  # nothing strayed onto local disk


def test_stock_model_checkpoint_last_on_s3_resumes(tmp_path: Path, s3_bucket: str, s3_server) -> None:
    ckpt = {"every_n_train_steps": 3, "save_top_k": -1, "save_last": True, "filename": "{step}"}
    cfg = {**BASE, "ckpt": ckpt, "safetensors": True}
    runs = _three_runs(tmp_path, cfg, f"{s3_bucket}/stock", s3_env(s3_server.endpoint), pause=7)
    h.assert_exact_resume(runs["out"], runs["c_out"], resumed_after=6)


pytestmark = pytest.mark.timeout(600)
