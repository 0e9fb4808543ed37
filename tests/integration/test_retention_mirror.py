"""``RetentionCheckpoint(mirror=Mirror("s3://..."))`` killed and resumed (moto server on 127.0.0.1): run A uninterrupted
(mirrored to its own prefix), run B mirrored and SIGKILLed from outside, run C a fresh process resuming
``fit(ckpt_path="last")``; C continues A bit for bit, and each tier holds what its rules keep.

The upload killed mid-way is real: the server holds the PUT of one checkpoint (a WSGI middleware in this
process) while B is killed, so that upload never completes; C must find the local copy kept, resume from
it and upload it again."""

from __future__ import annotations

import shutil
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Iterator

import fsspec
import pytest

from tests.helpers import kill_resume as h
from tests.helpers.s3 import S3Server, s3_env

BASE = {"n": 40, "batch_size": 4, "max_epochs": 2, "dropout": 0.2, "augment": True, "shuffle": True}
RULES = {"keep_last": 2, "anchor_every_n_steps": 9}
"""Saves at steps 3, 6, ..., 18. The bucket keeps the 2 most recent and an anchor per 9 steps (9, 18); the
local disk keeps the newest (and the resume source)."""

EXTENDED = frozenset(
    {
        "test_a_new_node_with_an_empty_local_disk_resumes_from_the_bucket_bit_for_bit",
        "test_ddp_with_sync_anchors_waits_on_the_store_and_resumes_bit_for_bit",
    }
)


class HoldUpload:
    """Hold every PUT/POST of the object named ``name`` until ``release`` is set, then answer it 500 without
    storing anything (the client that sent it is dead by then); once released, let every request through."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.held = threading.Event()
        self.release = threading.Event()

    def wrap(self, app: Callable) -> Callable:
        def middleware(environ: dict, start_response: Callable) -> Any:
            path = urllib.parse.unquote(environ.get("PATH_INFO", ""))
            upload = environ.get("REQUEST_METHOD") in ("PUT", "POST") and path.endswith(self.name)
            if upload and not self.release.is_set():
                self.held.set()
                self.release.wait(timeout=300)
                start_response("500 Internal Server Error", [("Content-Type", "application/xml")])
                return [b"<Error><Code>InternalError</Code><Message>held, then dropped</Message></Error>"]
            return app(environ, start_response)

        return middleware


@pytest.fixture
def hold_upload(s3_server: S3Server) -> Iterator[Callable[[str], HoldUpload]]:
    wsgi = s3_server._server._server  # the werkzeug server under moto's ThreadedMotoServer (as tests/helpers/s3.py)
    original = wsgi.app
    holds: list[HoldUpload] = []

    def hold(name: str) -> HoldUpload:
        holds.append(HoldUpload(name))
        wsgi.app = holds[-1].wrap(original)
        return holds[-1]

    try:
        yield hold
    finally:
        wsgi.app = original
        for held in holds:
            held.release.set()


def _names(url: str) -> list[str]:
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url[len("s3://") :])) if fs.exists(url) else []


def _cfg(url: str, anchors: str = "async") -> dict:
    mirror = {"url": url, "local_keep_last": 1, "anchors": anchors}
    retention = {"every_n_train_steps": 3, "retention": RULES, "mirror": mirror}
    return {**BASE, "retention": retention, "safetensors": True, "async": True}


def _local(ckpt_dir: str) -> list[str]:
    return sorted(p.name for p in Path(ckpt_dir).iterdir()) if Path(ckpt_dir).exists() else []


def test_an_upload_killed_mid_way_is_redone_and_the_run_resumes_bit_for_bit(
    tmp_path: Path, s3_bucket: str, s3_server: S3Server, hold_upload: Callable[[str], HoldUpload]
) -> None:
    env = s3_env(s3_server.endpoint)
    a = h.uninterrupted(dict(_cfg(f"{s3_bucket}/A"), env=env), tmp_path)
    assert _names(f"{s3_bucket}/A") == ["step=000000009.ckpt", "step=000000015.ckpt", "step=000000018.ckpt"]
    held = hold_upload("run/step=000000009.ckpt")
    cfg = _cfg(f"{s3_bucket}/run")
    b = dict(cfg, out=str(tmp_path / "B"), ckpt_dir=str(tmp_path / "B" / "ckpt"), pause_before=10, env=env)
    paused = Path(b["out"]) / "paused"
    h.run_and_kill_when(b, tmp_path, lambda: paused.exists() and held.held.is_set())
    held.release.set()
    assert "step=000000009.ckpt" in _local(b["ckpt_dir"])  # the local copy stays until the mirror has it
    left = _names(f"{s3_bucket}/run")
    assert "step=000000009.ckpt" not in left and not [n for n in left if ".tmp-" in n], left
    s3_server.faults.fail(3)  # C's first uploads (step 9 again) fail and botocore retries them, during training
    c = h.resumed(cfg, tmp_path, b["ckpt_dir"], env=env)
    assert s3_server.faults.seen == 3
    h.assert_exact_resume(a["out"], c["out"], resumed_after=9)  # the retries drew no number of training's RNGs
    # the bucket: the 2 most recent and the anchors of steps 9 (uploaded again by C) and 18
    assert _names(f"{s3_bucket}/run") == ["step=000000009.ckpt", "step=000000015.ckpt", "step=000000018.ckpt"]
    # the local disk: the newest, and the checkpoint C resumed from
    assert _local(b["ckpt_dir"]) == ["step=000000009.ckpt", "step=000000018.ckpt"]


def test_a_new_node_with_an_empty_local_disk_resumes_from_the_bucket_bit_for_bit(
    tmp_path: Path, s3_bucket: str, s3_server: S3Server
) -> None:
    env = s3_env(s3_server.endpoint)
    a = h.uninterrupted(dict(_cfg(f"{s3_bucket}/A"), env=env), tmp_path)
    cfg = _cfg(f"{s3_bucket}/run")
    b = dict(cfg, out=str(tmp_path / "B"), ckpt_dir=str(tmp_path / "B" / "ckpt"), pause_before=10, env=env)
    paused = Path(b["out"]) / "paused"
    h.run_and_kill_when(b, tmp_path, lambda: paused.exists() and "step=000000009.ckpt" in _names(f"{s3_bucket}/run"))
    shutil.rmtree(b["ckpt_dir"])  # the node is gone with its disk
    c = h.resumed(cfg, tmp_path, b["ckpt_dir"], env=env)
    assert f"resumes from {s3_bucket}/run/step=000000009.ckpt" in h.output(c, tail=None)
    h.assert_exact_resume(a["out"], c["out"], resumed_after=9)
    assert _names(f"{s3_bucket}/run") == ["step=000000009.ckpt", "step=000000015.ckpt", "step=000000018.ckpt"]
    assert _local(b["ckpt_dir"]) == ["step=000000018.ckpt"]


pytestmark = pytest.mark.timeout(600)


def test_ddp_with_sync_anchors_waits_on_the_store_and_resumes_bit_for_bit(
    tmp_path: Path, s3_bucket: str, s3_server: S3Server
) -> None:
    """DDP x2, ``Mirror(anchors="sync")``, a process group timeout of 3 s and every upload of an anchor slowed to
    8 s: rank 0 uploads the anchor before its save counts while rank 1 waits on the store, not in a collective
    (which would time out); killed after the anchor of step 9 and resumed bit for bit."""
    env = s3_env(s3_server.endpoint)
    wsgi = s3_server._server._server  # the werkzeug server under moto's ThreadedMotoServer (as tests/helpers/s3.py)
    original = wsgi.app

    def slow_anchors(environ: dict, start_response: Callable) -> Any:
        path = urllib.parse.unquote(environ.get("PATH_INFO", ""))
        if environ.get("REQUEST_METHOD") in ("PUT", "POST") and path.endswith(("=000000009.ckpt", "=000000018.ckpt")):
            time.sleep(8.0)
        return original(environ, start_response)

    wsgi.app = slow_anchors
    try:
        sync = {"n": 80, "devices": 2, "collective_timeout_s": 3}
        a_cfg = dict(_cfg(f"{s3_bucket}/A", anchors="sync"), **sync)
        a = h.uninterrupted(dict(a_cfg, env=env), tmp_path)
        assert _names(f"{s3_bucket}/A") == ["step=000000009.ckpt", "step=000000015.ckpt", "step=000000018.ckpt"]
        cfg = dict(_cfg(f"{s3_bucket}/run", anchors="sync"), **sync)
        b = dict(cfg, out=str(tmp_path / "B"), ckpt_dir=str(tmp_path / "B" / "ckpt"), pause_before=10, env=env)
        paused = Path(b["out"]) / "paused"
        h.run_and_kill_when(b, tmp_path, lambda: paused.exists())
        assert "step=000000009.ckpt" in _names(f"{s3_bucket}/run")  # uploaded before the save counted
        c = h.resumed(cfg, tmp_path, b["ckpt_dir"], env=env)
        h.assert_exact_resume(a["out"], c["out"], resumed_after=9)
    finally:
        wsgi.app = original
