"""No rank waits on rank 0's I/O inside a collective: DDP x2 with a process group timeout of 3 s and every
durable write slowed to 8 s, saving every 2 steps, so each save finds the previous write still running.
Rank 0 waits for it before the next snapshot; rank 1 must wait with it outside any collective (not in the
barrier after the save or the next gradient all-reduce, where gloo's 3 s timeout would end the run)."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import kill_resume as h

EXTENDED = frozenset({"test_the_same_with_retention_checkpoint_and_no_exact_resume"})

CFG = {
    "n": 32, "batch_size": 4, "devices": 2, "max_epochs": 1, "distributed_sampler": True,
    "safetensors": True, "async": True, "slow_write": 8.0, "collective_timeout_s": 3,
    "ckpt": {"every_n_train_steps": 2, "save_top_k": -1, "filename": "{step}"},
}  # fmt: skip


def test_a_write_slower_than_the_collective_timeout_keeps_training(tmp_path: Path) -> None:
    cfg = dict(CFG, out=str(tmp_path / "run"), ckpt_dir=str(tmp_path / "ckpt"))
    h.run(cfg, tmp_path, timeout=180)
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.ckpt")) == [f"step={s}.ckpt" for s in (2, 4)]
    steps = [s["step"] for s in h.steps(Path(cfg["out"]), 1)]
    assert steps == list(range(4))  # rank 1 trained every step: 16 samples each, batches of 4


def test_the_same_with_retention_checkpoint_and_no_exact_resume(tmp_path: Path) -> None:
    cfg = dict(CFG, out=str(tmp_path / "run"), ckpt_dir=str(tmp_path / "ckpt"), exact=False)
    cfg["retention"] = {"every_n_train_steps": 2, "retention": {"keep_last": 5}}
    h.run(cfg, tmp_path, timeout=180)
    assert len(list((tmp_path / "ckpt").glob("*.ckpt"))) == 2
    assert [s["step"] for s in h.steps(Path(cfg["out"]), 1)] == list(range(4))
