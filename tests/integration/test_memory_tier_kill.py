"""The memory tier across real processes: SIGKILL after a memory snapshot and before the next durable one;
a fresh ``fit(ckpt_path="last")`` resumes from shared memory, bit for bit, losing only the steps since that
snapshot; without the shared-memory file (a node loss) or with a damaged one, from disk, bit for bit.
Under DDP x2 both ranks resume from memory, or, when one rank's snapshot is missing, both from disk."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from lightning_resume.format.read import load_file
from lightning_resume.memory import store as memory_tier
from lightning_resume.schedule import history
from lightning_resume.schedule.state import Tier
from tests.helpers import kill_resume as h

EXTENDED = frozenset(
    {
        "test_kill_resumes_from_memory_or_disk_exactly",
    }
)
"""In make test-all only: one process: the DDP test resumes from memory and from disk too, on both ranks."""

DURABLE_EVERY, MEMORY_EVERY, KILL_AT = 6, 2, 9
"""Durable snapshots every 6 steps, memory ones every 2: killed at step 9, disk has step 6, memory step 8."""


def _cfg(tmp_path: Path, shm: Path, devices: int = 1) -> dict[str, Any]:
    memory = {"dir": str(shm), "every_n_train_steps_max": MEMORY_EVERY}
    exact = {"schedule": {"every_n_train_steps_max": DURABLE_EVERY}, "memory_tier": memory}
    return {
        "n": 40 * devices, "batch_size": 4, "max_epochs": 2, "dropout": 0.2, "augment": True, "shuffle": True,
        "devices": devices, "safetensors": True, "ckpt": {"save_top_k": 0}, "exact_args": exact,
        "ckpt_dir": str(tmp_path / "B" / "ckpt"), "flush_memory_tier": True,
    }  # fmt: skip


def _snapshots(shm: Path) -> list[Path]:
    return sorted(shm.glob("*/*/rank-*.safetensors"))


def _memory_step(path: Path) -> int:
    return int(load_file(str(path)).checkpoint[memory_tier.MEMORY_KEY]["step"])


def _failure_tiers(cfg: dict) -> list:
    """The tier each failure in the run's history resumed from (memory: the machine survived): the history in
    the newest checkpoint, which carries every start of the run."""
    newest = max(Path(cfg["ckpt_dir"]).glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    past = history.history_from_json(
        load_file(str(newest)).checkpoint["callbacks"]["ExactResume"]["schedule"]["history"]
    )
    return [e.tier for e in past.events if e.kind is history.EventKind.FAILURE]


def _kill_after_memory_snapshot(tmp_path: Path, shm: Path, devices: int) -> tuple[dict, Path]:
    """Run A uninterrupted and B until it is killed at step ``KILL_AT``; back B's state up."""
    cfg = _cfg(tmp_path, shm, devices)
    h.uninterrupted(cfg, tmp_path)
    assert not list(shm.glob("*/*/rank-*")), "a clean end of training frees the memory tier"
    h.run_until_paused(dict(cfg, out=str(tmp_path / "B"), pause_before=KILL_AT), tmp_path)
    assert [_memory_step(p) for p in _snapshots(shm)] == [8] * devices
    backup = tmp_path / "backup"
    shutil.copytree(shm, backup / "shm")
    shutil.copytree(cfg["ckpt_dir"], backup / "ckpt")
    return cfg, backup


def _resume(tmp_path: Path, cfg: dict, backup: Path, shm: Path, name: str) -> dict:
    """Put B's state back as it was at the kill (a previous resume consumed it)."""
    shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(cfg["ckpt_dir"], ignore_errors=True)
    shutil.copytree(backup / "shm", shm)
    shutil.copytree(backup / "ckpt", cfg["ckpt_dir"])
    return dict(cfg, out=str(tmp_path / name), resume="last")


@pytest.mark.slow
def test_kill_resumes_from_memory_or_disk_exactly(tmp_path: Path, shm: Path) -> None:
    cfg, backup = _kill_after_memory_snapshot(tmp_path, shm, devices=1)
    steps_a = len(h.steps(tmp_path / "A"))

    c = _resume(tmp_path, cfg, backup, shm, "C_memory")
    h.run(c, tmp_path)
    h.assert_exact_resume(tmp_path / "A", Path(c["out"]), resumed_after=8)  # lost: step 9 only (disk: 7..9)
    assert "resuming from the memory tier at step 8" in h.output(c)
    assert not _snapshots(shm), "freed at the clean end"
    assert _failure_tiers(cfg) == [Tier.MEMORY]  # a process failure, for the schedule's M1

    c = _resume(tmp_path, cfg, backup, shm, "C_node_lost")
    shutil.rmtree(shm)  # the machine is gone: so is its shared memory
    h.run(c, tmp_path)
    h.assert_exact_resume(tmp_path / "A", Path(c["out"]), resumed_after=DURABLE_EVERY)
    assert _failure_tiers(cfg) == [Tier.DURABLE]  # a node failure, for M2

    c = _resume(tmp_path, cfg, backup, shm, "C_corrupt")
    (snapshot,) = _snapshots(shm)
    data = bytearray(snapshot.read_bytes())
    data[-5] ^= 0x01
    snapshot.write_bytes(bytes(data))
    h.run(c, tmp_path)
    h.assert_exact_resume(tmp_path / "A", Path(c["out"]), resumed_after=DURABLE_EVERY)
    out = h.output(c)
    assert f"skipping the memory-tier snapshot {snapshot} on rank 0" in out and "checksum mismatch" in out
    assert steps_a == 20


@pytest.mark.slow
def test_ddp_ranks_resume_from_memory_together_or_from_disk_together(tmp_path: Path, shm: Path) -> None:
    cfg, backup = _kill_after_memory_snapshot(tmp_path, shm, devices=2)

    c = _resume(tmp_path, cfg, backup, shm, "C_memory")
    h.run(c, tmp_path)
    h.assert_exact_resume(tmp_path / "A", Path(c["out"]), resumed_after=8, ranks=2)

    c = _resume(tmp_path, cfg, backup, shm, "C_rank1_missing")
    next(shm.glob("*/*/rank-1-of-2.safetensors")).unlink()
    h.run(c, tmp_path)
    h.assert_exact_resume(tmp_path / "A", Path(c["out"]), resumed_after=DURABLE_EVERY, ranks=2)
    assert "no verified snapshot on rank(s) [1]" in h.output(c)
