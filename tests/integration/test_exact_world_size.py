"""Resuming on another world size: refused in exact mode with what differs; with strict=False the
weights, optimizer and schedule resume and the rest of the epoch is dealt out as ``elastic=True`` does
(tests/integration/test_exact_elastic.py), so that no sample of the epoch is trained twice or skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import kill_resume as h

CFG = {
    "n": 48,
    "batch_size": 4,
    "max_epochs": 1,
    "dropout": 0.2,
    "shuffle": True,
    "distributed_sampler": True,
    "ckpt": {"every_n_train_steps": 3, "save_top_k": -1, "save_last": True, "filename": "{step}"},
}


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ddp")
    h.run_until_paused(dict(CFG, devices=2, out=str(root / "B"), ckpt_dir=str(root / "ckpt"), pause_before=5), root)
    return root


def test_changed_world_size_is_refused_in_exact_mode(two_rank_checkpoint: Path, tmp_path: Path) -> None:
    c = dict(
        CFG,
        out=str(tmp_path / "C"),
        ckpt_dir=str(two_rank_checkpoint / "ckpt"),
        resume=str(two_rank_checkpoint / "ckpt" / "step=3.ckpt"),
    )
    assert h.exit_code(c, tmp_path) != 0
    out = h.output(c)
    assert "ResumeMismatchError" in out and "checkpoint written by 2 processes, this run has 1" in out
    assert "pass ExactResume(elastic=True)" in out


def test_changed_world_size_remaps_the_data_position(two_rank_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = two_rank_checkpoint / "ckpt" / "step=3.ckpt"
    c = dict(CFG, strict=False, out=str(tmp_path / "C"), ckpt_dir=str(tmp_path / "ckpt"), resume=str(ckpt))
    h.run(c, tmp_path)
    out = h.output(c)
    assert "resumed a checkpoint of 2 ranks on 1: the 24 samples of epoch 0 not yet trained are dealt" in out
    before = [i for r in range(2) for s in h.steps(two_rank_checkpoint / "B", r) if s["step"] < 3 for i in s["ids"]]
    after = [i for s in h.steps(c["out"]) for i in s["ids"]]
    assert len(before) == 24 and len(after) == 24
    assert sorted(before + after) == list(range(48))  # every sample of the epoch exactly once
