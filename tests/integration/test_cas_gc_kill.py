"""SIGKILL inside a pack collection, then resume: every kept checkpoint verifies, and the run continues bit for bit.

A frozen-backbone fine-tune saved with ``dedupe=True`` and ``keep_last=2`` (``jobs/dedupe_gc_job.py``). Run B is
killed during a prune: retention has removed a checkpoint, and the pack only it referenced is about to go. Run C
resumes B's "last" and is killed during its cleanup: at its first save it collects the pack B left, and dies
before removing it. Run D resumes again and finishes. After each kill every checkpoint in the directory verifies
(packs included); D continues the uninterrupted run A bit for bit, and at its end the directory holds exactly the
packs its checkpoints reference. Locally, and on the S3 test server (moto on 127.0.0.1).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_resume.cas.layout import BLOCKS
from lightning_resume.cas.refs import packs_of
from lightning_resume.io.resolve import candidates
from lightning_resume.io.verify import verify
from lightning_resume.storage import files as storage
from tests.helpers import kill_resume as h
from tests.helpers.s3 import s3_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

CFG = {
    "job": "dedupe_gc_job.py",
    "safetensors": True,
    "io_args": {"dedupe": True},
    "retention": {"retention": {"keep_last": 2}, "every_n_train_steps": 2},
    "max_epochs": 2,
}


def _killed_in(cfg: dict, workdir: Path, phase: str) -> None:
    rc = h.exit_code(dict(cfg, kill_in=phase), workdir)
    assert rc == -9 and f"KILLED IN {phase} BEFORE" in h.output(cfg), h.output(cfg)


def _all_verify(directory: str) -> list:
    checkpoints = [e.path for e in candidates(directory, (".ckpt",))]
    assert len(checkpoints) >= 2, checkpoints
    for path in checkpoints:
        verify(path)  # every block of every pack it references, hashed
    return checkpoints


def _kill_prune_then_cleanup_then_resume(workdir: Path, directory: str, env: dict, cfg: dict = CFG) -> None:
    a = h.uninterrupted(cfg, workdir)
    b = dict(cfg, out=str(workdir / "B"), ckpt_dir=directory, env=env)
    _killed_in(b, workdir, "prune")
    _all_verify(directory)
    c = dict(cfg, out=str(workdir / "C-killed"), ckpt_dir=directory, resume="last", env=env)
    _killed_in(c, workdir, "cleanup")
    _all_verify(directory)
    d = h.resumed(cfg, workdir, directory, env=env)
    h.assert_exact_resume(a["out"], d["out"], resumed_after=None)
    kept = _all_verify(directory)
    referenced = {f"{name}.safetensors" for path in kept for name in packs_of(path)}
    assert {e.name for e in storage.list_dir(storage.join(directory, BLOCKS))} == referenced


def test_killed_in_a_prune_and_in_a_cleanup_locally(tmp_path: Path) -> None:
    _kill_prune_then_cleanup_then_resume(tmp_path, str(tmp_path / "ckpt"), {})


@pytest.mark.extended
def test_killed_in_a_prune_and_in_a_cleanup_on_s3(tmp_path: Path, s3_bucket: str, s3_server) -> None:
    _kill_prune_then_cleanup_then_resume(tmp_path, f"{s3_bucket}/run", s3_env(s3_server.endpoint))


@pytest.mark.extended
def test_killed_in_a_prune_and_in_a_cleanup_with_async_saves(tmp_path: Path) -> None:
    cfg = dict(CFG, **{"async": True})  # collections run on the writer thread, after the writes before them
    _kill_prune_then_cleanup_then_resume(tmp_path, str(tmp_path / "ckpt"), {}, cfg)
