"""Sharded checkpoints on ``s3://`` (moto server on 127.0.0.1): FSDP2 on 2 gloo ranks saves, 3 ranks load
bitwise; a SIGKILL mid-save and a fresh resume; Lightning's ``ShardedModelParallelStrategy`` with retention and
"last" on S3, resumed bit for bit.

The jobs are tests/helpers/jobs/sharded_job.py (raw FSDP2) and sharded_lightning_job.py; the children reach the
server through ``AWS_ENDPOINT_URL_S3`` (``tests/helpers/s3.py``). One test runs in CI's subset; the kill and
Lightning runs are ``extended``.
"""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest
import torch

from lightning_resume import load_full, newest_committed, verify_sharded
from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.sharded.api import load_meta
from lightning_resume.sharded.marker import DATA, MARKER
from tests.helpers import processes, sharded_runs
from tests.helpers.paths import job_script
from tests.helpers.s3 import s3_env

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.timeout(600)]

EXTENDED = frozenset(
    {
        "test_sigkill_during_a_save_to_s3_then_resume_in_fresh_processes_is_bitwise",
        "test_lightning_retention_and_last_on_s3_resume_bitwise",
    }
)


def raw(out: Path, env: dict, *flags: str, timeout: float = 180) -> dict:
    processes.finish(
        processes.start([job_script("sharded_job.py"), out, *flags], env={**sharded_runs.ENV, **env}), timeout
    )
    return torch.load(out / "final.pt", weights_only=True)


def fit(out: Path, env: dict, ckpt: str | None, *flags: str, timeout: float = 240) -> dict:
    args = [job_script("sharded_lightning_job.py"), out, *([ckpt] if ckpt else []), *flags]
    processes.finish(processes.start(args, env={**sharded_runs.ENV, **env}), timeout)
    return torch.load(out / "final.pt", weights_only=True)


def keys(url: str) -> list:
    """Every object under ``url``, relative to it."""
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    base = url[len("s3://") :].rstrip("/") + "/"
    return sorted(k[len(base) :] for k in fs.find(base))


def assert_bitwise(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def test_fsdp2_saves_to_s3_on_two_ranks_and_three_ranks_load_it_bitwise(tmp_path, s3_bucket, s3_server):
    env, root = s3_env(s3_server.endpoint), f"{s3_bucket}/ckpt"
    expected = raw(tmp_path / "train", env, "--root", root, "--steps", "4")
    objects = keys(root)
    assert {o.split("/")[0] for o in objects} == {"step-0002", "step-0004"}
    for name in ("step-0002", "step-0004"):  # the marker, and one versioned prefix it names
        mine = [o.split("/", 1)[1] for o in objects if o.startswith(name + "/")]
        (version,) = {o.split("/")[0] for o in mine if o != MARKER}
        assert DATA.match(version) and MARKER in mine
        assert sorted(o for o in mine if o != MARKER) == sorted(
            f"{version}/{f}" for f in (".metadata", "__0_0.distcp", "__1_0.distcp", "meta.safetensors")
        )
    last = newest_committed(root)
    assert last == f"{root}/step-0004"
    record = verify_sharded(last)
    assert (record.step, record.world_size) == (4, 2)
    assert load_meta(last, record)["step"] == 4
    assert_bitwise(expected["model"], load_full(last)["model"])  # one process, no group: resharded to full

    on_three = raw(tmp_path / "three", env, "--world", "3", "--load-only", last)  # 2 ranks -> 3
    assert_bitwise(expected["model"], on_three["model"])
    assert not (tmp_path / "train" / "ckpt").exists() or not any((tmp_path / "train" / "ckpt").iterdir())
    assert not Path("s3:").exists()  # nothing strayed onto local disk


def test_sigkill_during_a_save_to_s3_then_resume_in_fresh_processes_is_bitwise(tmp_path, s3_bucket, s3_server):
    env, root = s3_env(s3_server.endpoint), f"{s3_bucket}/ckpt"
    expected = raw(tmp_path / "full", env, "--root", f"{s3_bucket}/full")
    out = tmp_path / "killed"
    proc = processes.start(
        [job_script("sharded_job.py"), out, "--root", root, "--stall-at", "4"], env={**sharded_runs.ENV, **env}
    )
    sharded_runs.kill_when_paused(proc, out, timeout=180)  # every rank wrote its shards; no marker yet
    staged = [o for o in keys(root) if o.startswith("step-0004/")]
    assert staged and MARKER not in {o.split("/", 1)[1] for o in staged}
    with pytest.raises(CheckpointCorruptError, match="no COMMITTED"):
        verify_sharded(f"{root}/step-0004")
    assert newest_committed(root) == f"{root}/step-0002"

    resumed = raw(out, env, "--root", root, "--resume")  # cleans the dead save's version first
    assert_bitwise(expected["model"], resumed["model"])
    assert all(torch.equal(a, b) for a, b in zip(expected["losses"][2:], resumed["losses"], strict=True))
    assert torch.equal(
        expected["optim"]["state"]["0.weight"]["exp_avg_sq"], resumed["optim"]["state"]["0.weight"]["exp_avg_sq"]
    )
    record = verify_sharded(f"{root}/step-0004")
    versions = {o.split("/")[1] for o in keys(root) if o.startswith("step-0004/") and o != f"step-0004/{MARKER}"}
    assert versions == {record.data}  # the killed save's version was removed (its owner's pid is dead)


def test_lightning_retention_and_last_on_s3_resume_bitwise(tmp_path, s3_bucket, s3_server):
    """``RetentionCheckpoint(retention=RetentionPolicy(keep_last=2))`` prunes sharded directories on S3; "last" skips a newer corrupt file
    and a directory whose commit never happened, and resumes the newest committed one bit for bit."""
    env, root = s3_env(s3_server.endpoint), f"{s3_bucket}/run"
    full = fit(tmp_path / "full", env, None, "--retention", "--ckpt-dir", root)
    names = sorted({o.split("/")[0] for o in keys(root)})
    assert names == ["step=000000004.ckpt", "step=000000006.ckpt"], names
    fs = fsspec.filesystem("s3")
    fs.rm(f"{root}/step=000000006.ckpt/{MARKER}"[len("s3://") :])  # as if killed before its commit
    fs.pipe_file(f"{root}/step=000000009.ckpt"[len("s3://") :], b"\x00" * 64)  # a newer file that is corrupt
    resumed = fit(tmp_path / "resumed", env, "last", "--retention", "--ckpt-dir", root)
    assert not list((tmp_path / "resumed").glob("error-*.txt")), (tmp_path / "resumed" / "error-0.txt").read_text()
    assert len(resumed["losses"]) == 2  # resumed at step 4, trained 5 and 6
    assert torch.equal(torch.stack(full["losses"][4:]), torch.stack(resumed["losses"]))
    assert_bitwise(full["model"], resumed["model"])
    assert verify_sharded(f"{root}/step=000000006.ckpt").step == 6  # re-saved and committed by the resumed run
