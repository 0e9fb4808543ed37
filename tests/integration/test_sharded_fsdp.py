"""FSDP2 (``fully_shard``) on 2 CPU processes over gloo: SIGKILL mid-save, resume bitwise, reshard on 1 and 4,
and a save that fails on one rank fails promptly on every rank.

Lightning's ``FSDPStrategy`` refuses CPU, so this is raw FSDP2 + our DCP commit protocol
(tests/helpers/jobs/sharded_job.py); the Lightning path is ``ModelParallelStrategy`` (test_sharded_lightning.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from lightning_resume import load_full, newest_committed, verify_sharded
from lightning_resume.errors import CheckpointCorruptError
from tests.helpers import sharded_runs

EXTENDED = frozenset(
    {
        "test_save_on_two_load_on_one_and_four_gives_the_same_full_weights",
    }
)
"""In make test-all only: resharding on load stays in make test through test_sharded_s3 (2 ranks -> 3) and test_sharded_elastic."""

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def assert_bitwise(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple:
    out = tmp_path_factory.mktemp("uninterrupted")
    return out, sharded_runs.raw(out, "--bad-meta")


def kill_while_committing(out: Path, step: int) -> None:
    proc = sharded_runs.start_raw(out, "--stall-at", str(step))
    sharded_runs.kill_when_paused(proc, out)  # every rank, mid-save: shards written, marker not yet


@pytest.mark.slow
def test_sigkill_during_a_save_then_resume_in_fresh_processes_is_bitwise(tmp_path, uninterrupted):
    _, expected = uninterrupted
    kill_while_committing(tmp_path, step=4)
    root = tmp_path / "ckpt"
    assert not (root / "step-0004").exists()  # every rank wrote into a hidden staging directory
    (staging,) = [n for n in os.listdir(root) if n.startswith(".step-0004.partial-")]
    assert (root / staging / "__1_0.distcp").exists()  # the shards were there, only the commit was missing
    with pytest.raises(CheckpointCorruptError, match="no COMMITTED"):
        verify_sharded(str(root / staging))
    assert newest_committed(str(root)) == str(root / "step-0002")

    resumed = sharded_runs.raw(tmp_path, "--resume")
    assert_bitwise(expected["model"], resumed["model"])
    assert all(torch.equal(a, b) for a, b in zip(expected["losses"][2:], resumed["losses"]))
    assert torch.equal(
        expected["optim"]["state"]["0.weight"]["exp_avg_sq"], resumed["optim"]["state"]["0.weight"]["exp_avg_sq"]
    )
    assert verify_sharded(str(root / "step-0004")).world_size == 2
    assert not (root / staging).exists()  # the stale staging directory was cleaned up on resume


def test_save_on_two_load_on_one_and_four_gives_the_same_full_weights(tmp_path, uninterrupted):
    out, expected = uninterrupted
    last = newest_committed(str(out / "ckpt"))
    assert last.endswith("step-0006")
    on_one = load_full(last)["model"]  # one process, no process group: DCP reshards to full tensors
    assert_bitwise(expected["model"], on_one)
    on_four = sharded_runs.raw(tmp_path, "--world", "4", "--load-only", last)
    assert_bitwise(expected["model"], on_four["model"])


def test_a_save_failing_on_one_rank_raises_the_same_error_on_every_rank_within_seconds(uninterrupted):
    """Before any collective every rank encodes the non-sharded part; rank 0's file errors are broadcast.

    The job ran these saves first (``--bad-meta``) with a 30 s process-group timeout: a rank left
    waiting at a collective would have failed the job.
    """
    out, _ = uninterrupted
    ranks = [json.loads((out / f"bad-meta-{rank}.json").read_text()) for rank in (0, 1)]
    for case in ("both", "rank1", "rank0-io"):
        (error0, seconds0), (error1, seconds1) = ranks[0][case], ranks[1][case]
        assert error0 == error1 and error0.startswith("ShardedSaveError: "), (case, error0, error1)
        assert max(seconds0, seconds1) < 10, (case, seconds0, seconds1)
    both, rank1, rank0_io = (ranks[0][case][0] for case in ("both", "rank1", "rank0-io"))
    assert "ranks 0, 1: UnencodableValueError: cannot store checkpoint value at 'hyper_parameters.loss'" in both
    assert "(rank 1: UnencodableValueError: cannot store checkpoint value at 'hyper_parameters.loss'" in rank1
    assert "create its staging directory (rank 0: " in rank0_io
    assert verify_sharded(str(out / "bad-meta" / "good")).world_size == 2  # the group stayed in step
    assert sorted(os.listdir(out / "bad-meta")) == ["a-file", "good"]  # no staging directory left behind
