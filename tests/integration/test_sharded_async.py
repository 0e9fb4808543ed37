"""Async sharded saves (``AsyncShardedSaver``, ``ShardedModelParallelStrategy(save="async")``).

Multi-process cases run FSDP2 on 2 CPU processes over gloo in their own process group (killed with
``killpg`` on timeout): raw FSDP2 in tests/helpers/jobs/sharded_job.py, Lightning in
tests/helpers/jobs/sharded_lightning_job.py. The one-process cases are in
tests/unit/sharded/test_sharded_async_saver.py.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from lightning_resume import load_full, newest_committed, verify_sharded
from lightning_resume.sharded.api import load_meta
from tests.helpers import sharded_runs
from tests.helpers.compare import assert_bitwise

EXTENDED = frozenset(
    {
        "test_sigkill_during_a_background_write_keeps_the_previous_checkpoint_newest_and_resume_is_bitwise",
    }
)
"""In make test-all only: test_sharded_fsdp's SIGKILL mid-save and the Lightning async fit here cover the kill and the async commit."""

STEPS = ("step-0002", "step-0004", "step-0006")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def async_run(tmp_path_factory) -> tuple:
    """6 steps, async save every 2 (each also saved synchronously first, into ckpt-sync), every
    background write delayed 0.3 s so the next optimizer steps run while it is in flight; then the
    injected background failures of ``--async-faults``."""
    out = tmp_path_factory.mktemp("async")
    return out, sharded_runs.raw(out, "--async", "--twin-sync", "--slow-write", "0.3", "--async-faults")


def test_async_save_commits_the_same_files_and_contents_as_the_sync_save(async_run):
    out, _ = async_run
    assert newest_committed(str(out / "ckpt")) == str(out / "ckpt" / "step-0006")
    for name in STEPS:
        sync, background = verify_sharded(str(out / "ckpt-sync" / name)), verify_sharded(str(out / "ckpt" / name))
        assert background.step == sync.step and background.world_size == sync.world_size == 2
        assert (
            set(background.files)
            == set(sync.files)
            == {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.safetensors"}
        )
        for file in set(sync.files) - {".metadata"}:  # .metadata names the (staging) directory it was written to
            assert background.files[file] == sync.files[file], (name, file)
        assert_bitwise(load_full(str(out / "ckpt-sync" / name)), load_full(str(out / "ckpt" / name)), name)
        assert_bitwise(load_meta(str(out / "ckpt-sync" / name)), load_meta(str(out / "ckpt" / name)), name)
    assert sorted(os.listdir(out / "ckpt")) == list(STEPS)  # no staging directory left


def test_the_optimizer_step_after_an_async_save_does_not_leak_into_its_checkpoint(async_run):
    out, _ = async_run
    for rank in (0, 1):
        report = json.loads((out / f"async-{rank}.json").read_text())
        # each save returned with its write (0.3 s of it asleep) still pending: the training thread did not pay it
        assert report["in_flight"] == [True, True, True]
    at_2, at_4 = load_full(str(out / "ckpt" / "step-0002")), load_full(str(out / "ckpt" / "step-0004"))
    assert not torch.equal(at_2["model"]["0.weight"], at_4["model"]["0.weight"])  # the state did move on
    assert_bitwise(load_full(str(out / "ckpt-sync" / "step-0002")), at_2)  # ...and not into the checkpoint


def test_a_failed_background_write_raises_on_both_ranks_at_the_next_save_and_at_close(async_run):
    out, _ = async_run
    ranks = [json.loads((out / f"async-faults-{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0] == ranks[1]
    for case in ("next-save", "close"):
        error = ranks[0][case]
        assert error.startswith(f"ShardedSaveError: sharded save of {out / 'async-faults' / f'bad-{case}'} failed")
        assert "(rank 1: OSError: [Errno 28] No space left on device (injected))" in error
    assert sorted(os.listdir(out / "async-faults")) == ["good-2"]  # nothing uncommitted left; still in step
    assert verify_sharded(str(out / "async-faults" / "good-2")).world_size == 2


@pytest.mark.slow
def test_sigkill_during_a_background_write_keeps_the_previous_checkpoint_newest_and_resume_is_bitwise(
    tmp_path, async_run
):
    _, expected = async_run
    proc = sharded_runs.start_raw(tmp_path, "--async", "--stall-async-at", "4")
    sharded_runs.kill_when_paused(proc, tmp_path)  # rank 0 mid-write of step 4, rank 1 waiting to commit it
    root = tmp_path / "ckpt"
    (staging,) = [n for n in os.listdir(root) if n.startswith(".step-0004.partial-")]
    assert (root / staging / "__0_0.distcp").exists() and not (root / staging / "COMMITTED").exists()
    assert newest_committed(str(root)) == str(root / "step-0002")
    assert load_meta(str(root / "step-0002"))["step"] == 2 and "optim" in load_full(str(root / "step-0002"))

    resumed = sharded_runs.raw(tmp_path, "--async", "--resume")
    assert_bitwise(expected["model"], resumed["model"])
    assert_bitwise(expected["losses"][2:], resumed["losses"])
    assert not (root / staging).exists() and sorted(os.listdir(root)) == list(STEPS)


def test_lightning_async_fit_resumes_bitwise_and_a_failed_last_write_raises_at_teardown_on_both_ranks(tmp_path):
    full = sharded_runs.fit(tmp_path / "full", None, "--async", "--retention", "--snapshot-every", "3")
    root = tmp_path / "full" / "ckpt"
    assert sorted(n for n in os.listdir(root) if n.endswith(".ckpt")) == ["step=000000004.ckpt", "step=000000006.ckpt"]
    assert newest_committed(str(root)) == str(root / "step=000000006.ckpt")  # committed by the end of fit
    assert not [n for n in os.listdir(root) if n.startswith(".")]

    resumed = sharded_runs.fit(
        tmp_path / "resumed", str(root / "step=000000004.ckpt"), "--async", "--fail-write-at", "6"
    )
    assert_bitwise(full["losses"][4:], resumed["losses"])
    assert_bitwise(full["model"], resumed["model"])
    for rank in (0, 1):
        error = (tmp_path / "resumed" / f"error-{rank}.txt").read_text()
        last = tmp_path / "resumed" / "ckpt" / "epoch=0-step=6.ckpt"
        assert error.startswith(
            f"ShardedSaveError: sharded save of {last} failed to write its shards in the background"
            " (rank 1: OSError: [Errno 5] Input/output error (injected))"
        ), error
        assert "in teardown" in error  # raised by the strategy's teardown (ModelCheckpoint never waits)
    assert os.listdir(tmp_path / "resumed" / "ckpt") == []
