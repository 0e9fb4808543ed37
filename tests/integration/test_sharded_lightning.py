"""Lightning ``ModelParallelStrategy`` (FSDP2) on 2 CPU processes: committed pickle-free DCP dirs, exact resume.

(``ShardedCheckpointIO.remove_checkpoint`` in one process: tests/unit/sharded/test_sharded_checkpoint_io.py.)"""

from __future__ import annotations

import os

import pytest
import torch

from lightning_resume import load_full, newest_committed, verify_sharded
from lightning_resume.io.sharded_strategy import ShardedCheckpointIO
from lightning_resume.sharded.api import load_meta
from tests.helpers import sharded_runs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_trainer_checkpoints_are_committed_dcp_dirs_and_fit_resumes_bitwise(tmp_path):
    full = sharded_runs.fit(tmp_path / "full")
    root = tmp_path / "full" / "ckpt"
    names = sorted(os.listdir(root))
    assert names == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt"]
    for name in names:
        record = verify_sharded(str(root / name))
        assert record.world_size == 2 and f"step={record.step}" in name
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.safetensors"} <= set(record.files)
        assert "meta.pt" not in os.listdir(root / name)  # no pickle for the non-sharded part
    ShardedCheckpointIO().verify_checkpoint(str(root / names[0]))
    meta = load_meta(str(root / names[0]))
    assert meta["global_step"] == 2 and any(k.startswith("ExactResume") for k in meta["callbacks"])
    assert newest_committed(str(root)) == str(root / names[-1])

    resumed = sharded_runs.fit(tmp_path / "resumed", str(root / names[0]))  # fresh processes
    assert len(resumed["losses"]) == 4 and torch.equal(torch.stack(full["losses"][2:]), torch.stack(resumed["losses"]))
    assert all(torch.equal(full["model"][k], resumed["model"][k]) for k in full["model"])
    consolidated = load_full(str(root / names[-1]))["state_dict"]
    assert all(torch.equal(full["model"][k], consolidated[k]) for k in full["model"])


def test_retention_prunes_sharded_directories_and_last_finds_the_newest(tmp_path):
    """RetentionCheckpoint keeps the 2 newest committed directories, and "last" resumes the newest."""
    full = sharded_runs.fit(tmp_path / "full", None, "--retention")
    root = tmp_path / "full" / "ckpt"
    assert sorted(n for n in os.listdir(root) if n.endswith(".ckpt")) == ["step=000000004.ckpt", "step=000000006.ckpt"]
    os.remove(root / "step=000000006.ckpt" / "COMMITTED")  # as if killed before its commit: not "last"
    resumed = sharded_runs.fit(tmp_path / "full", "last", "--retention")
    assert len(resumed["losses"]) == 2  # resumed at step 4, trained 5 and 6
    assert torch.equal(torch.stack(full["losses"][4:]), torch.stack(resumed["losses"]))
    assert all(torch.equal(full["model"][k], resumed["model"][k]) for k in full["model"])
