"""The memory tier's store: atomic replace, verified load, size check, clean-end free, stale cleanup by
ownership; and the rule that decides whether ranks resume from memory."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_resume import ConfigurationError, ExactResume, ExactResumeWarning, MemoryTierOptions
from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.format.atomic import owner_token
from lightning_resume.format.write import save_file
from lightning_resume.memory import peers
from lightning_resume.memory import store as memory_tier
from lightning_resume.memory.store import MemoryStore, NotEnoughSharedMemory, durable_run, durable_step, slot_key

K = "0123456789abcdef"
"""A slot name (16 hex digits, as ``slot_key`` makes them)."""


def _root(tmp_path: Path) -> str:
    return memory_tier.memory_root(str(tmp_path))


def _state(step: int) -> dict:
    return {"global_step": step, "w": torch.arange(6, dtype=torch.float32) + step, "loops": {"x": step}}


def test_save_load_roundtrip_and_replace(tmp_path: Path) -> None:
    store = MemoryStore(_root(tmp_path), K, rank=0, world_size=1)
    state = _state(5)
    store.save(_state(3), step=3, seq=1, run="r")
    store.save(state, step=5, seq=2, run="r")
    state["w"].add_(100)  # the snapshot was copied when save returned: later changes are not in it
    store.wait()
    snap = MemoryStore(_root(tmp_path), K, rank=0, world_size=1).load("r")  # what a new process finds
    assert snap is not None and (snap.step, snap.seq) == (5, 2)
    assert torch.equal(snap.checkpoint["w"], _state(5)["w"]) and memory_tier.MEMORY_KEY not in snap.checkpoint
    assert sorted(os.listdir(Path(_root(tmp_path)) / K)) == [
        "rank-0-of-1.owner",
        "rank-0-of-1.safetensors",
    ]  # one snapshot


def test_later_snapshots_reuse_the_encoding_and_each_holds_its_own_step(tmp_path: Path) -> None:
    """The record (step, sequence, time) changes at every snapshot; the tree's shape does not, so the encoding
    is kept (constant per-tensor cost) and each file still holds its own record and values."""
    store = MemoryStore(_root(tmp_path), K, rank=0, world_size=1)
    for step in (3, 4, 5):
        store.save(_state(step), step=step, seq=step - 2, run="r")
    store.wait()
    saver = store._saver
    assert saver is not None and saver.encoder.encoded == 1 and saver.encoder.reused == 2
    snap = store.load("r")
    assert snap is not None and (snap.step, snap.seq) == (5, 3)
    assert torch.equal(snap.checkpoint["w"], _state(5)["w"]) and snap.checkpoint["loops"] == {"x": 5}


def test_overlap_copy_needs_the_asynchronous_store(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="overlap_copy=True .* needs asynchronous=True"):
        MemoryStore(_root(tmp_path), K, rank=0, world_size=1, asynchronous=False, overlap_copy=True)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_failed_save_leaves_the_previous_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asynchronous: bool
) -> None:
    store = MemoryStore(_root(tmp_path), K, rank=0, world_size=1, asynchronous=asynchronous)
    store.save(_state(3), step=3, seq=1, run="r")
    store.wait()

    def crash(src: str, dst: str, **dir_fds: int) -> None:
        raise OSError("killed before the rename")

    monkeypatch.setattr("lightning_resume.format.atomic.os.replace", crash)
    with pytest.raises(OSError, match="before the rename"):
        store.save(_state(9), step=9, seq=2, run="r")
        store.wait()  # asynchronous: the worker's failure is reported here
    monkeypatch.undo()
    snap = store.load("r")
    assert snap is not None and snap.step == 3  # the new one never replaced the old one
    assert sorted(os.listdir(Path(_root(tmp_path)) / K)) == [
        "rank-0-of-1.owner",
        "rank-0-of-1.safetensors",
    ]  # no temporary


def test_a_damaged_or_foreign_snapshot_is_refused(tmp_path: Path) -> None:
    store = MemoryStore(_root(tmp_path), K, rank=0, world_size=2)
    store.save(_state(3), step=3, seq=1, run="r")
    store.wait()
    with pytest.raises(CheckpointCorruptError, match="this run's"):
        store.load("another run")  # the durable checkpoint names another run: not ours to resume
    other = MemoryStore(_root(tmp_path), K, rank=1, world_size=2)
    Path(other.path).write_bytes(Path(store.path).read_bytes())  # rank 0's file in rank 1's slot
    with pytest.raises(CheckpointCorruptError, match="not this slot's"):
        other.load("r")
    data = bytearray(Path(store.path).read_bytes())
    data[-3] ^= 0xFF  # one flipped bit in the tensor bytes
    Path(store.path).write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="rank-0-of-2.safetensors"):
        store.load("r")
    with pytest.warns(ExactResumeWarning, match=f"skipping the memory-tier snapshot {store.path} on rank 0"):
        mine, offered = peers.offer(store, "r", [], durable_step=-1)
    assert mine is None and offered.own is None and offered.refused[0].path == store.path


def test_size_check_names_needed_free_and_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_tier, "free_bytes", lambda directory: 1000)
    store = MemoryStore(_root(tmp_path), K, rank=0, world_size=1)
    big = {"global_step": 1, "w": torch.zeros(1 << 20)}
    with pytest.raises(NotEnoughSharedMemory) as err:
        store.save(big, step=1, seq=1, run="r")
    message = str(err.value)
    assert "needs 5.0 MiB" in message and "0.0 MiB free" in message
    assert "/dev/shm" in message and "memory_tier=None" in message
    assert not store.exists()


def test_clean_end_frees_everything(tmp_path: Path) -> None:
    stores = [MemoryStore(_root(tmp_path), K, rank=r, world_size=2) for r in range(2)]
    for s in stores:
        s.save(_state(1), step=1, seq=1, run="r")
        s.wait()
    stores[0].free()
    assert not stores[0].exists() and stores[1].exists()
    stores[1].free()
    assert os.listdir(_root(tmp_path)) == []


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _other_run(root: Path, name: str, owner: str, age_s: float) -> Path:
    directory = root / name
    directory.mkdir(mode=0o700, parents=True)
    (directory / "rank-0-of-1.safetensors").write_bytes(b"x")
    (directory / "rank-0-of-1.owner").write_text(owner)
    old = time.time() - age_s
    for p in directory.iterdir():
        os.utime(p, (old, old))
    return directory


def test_stale_cleanup_removes_only_unowned_old_runs(tmp_path: Path) -> None:
    day, root = memory_tier.STALE_AFTER_S, Path(_root(tmp_path))
    root.mkdir(mode=0o700)
    dead = _other_run(root, "a" * 16, f"{owner_token()} {_dead_pid()}", 2 * day)
    alive = _other_run(root, "b" * 16, f"{owner_token()} {os.getpid()}", 2 * day)
    recent = _other_run(root, "c" * 16, f"{owner_token()} {_dead_pid()}", 60)  # a crashed run's relaunch
    foreign = _other_run(root, "d" * 16, f"{'0' * 12} 1", 2 * day)  # another host: age decides
    mine = _other_run(root, K, f"{owner_token()} {_dead_pid()}", 2 * day)
    removed = MemoryStore(str(root), K, rank=0, world_size=1).clean_stale()
    assert sorted(removed) == sorted([str(dead), str(foreign)])
    assert alive.exists() and recent.exists() and mine.exists()


def test_the_slot_names_the_directory_and_the_run_travels_in_checkpoints(tmp_path: Path) -> None:
    assert slot_key("s3://b/ckpt") != slot_key("/local/ckpt") and len(slot_key("x")) == 16
    save_file({**_state(4), "callbacks": {"ExactResume": {"memory_run": "abc"}}}, str(tmp_path / "a.ckpt"))
    torch.save({"global_step": 4, "callbacks": {"ExactResume": {"memory_run": "def"}}}, tmp_path / "b.ckpt")
    save_file(_state(4), str(tmp_path / "c.ckpt"))
    assert durable_run(str(tmp_path / "a.ckpt")) == "abc" and durable_run(str(tmp_path / "b.ckpt")) == "def"
    assert durable_run(str(tmp_path / "c.ckpt")) is None and durable_run(None) is None


def test_durable_step_reads_every_format_lightning_writes(tmp_path: Path) -> None:
    """Before, a ``torch.save`` checkpoint (Lightning's default) read as -1, so an older memory snapshot beat it."""
    save_file(_state(42), str(tmp_path / "a.ckpt"))
    torch.save({"global_step": 3}, tmp_path / "last.ckpt")
    torch.save({"global_step": 3}, tmp_path / "epoch=0-step=7.ckpt")
    assert durable_step(str(tmp_path / "a.ckpt")) == 42
    assert durable_step(str(tmp_path / "last.ckpt")) == 3
    assert durable_step(str(tmp_path / "epoch=0-step=7.ckpt")) == 7
    assert durable_step(None) == -1 and durable_step(str(tmp_path / "missing.ckpt")) == -1


def test_memory_options_are_checked_at_construction() -> None:
    with pytest.raises(ConfigurationError) as err:
        ExactResume(mtbf=None, memory_tier=MemoryTierOptions(process_mtbf="soon", every_n_train_steps_max=0))
    text = str(err.value)
    assert "memory_tier.process_mtbf='soon' is not a duration" in text
    assert "memory_tier.every_n_train_steps_max=0 must be an integer >= 1" in text
    with pytest.raises(ConfigurationError, match=r"memory_tier=True must be a MemoryTierOptions\(\.\.\.\); in YAML"):
        ExactResume(mtbf=None, memory_tier=True)  # type: ignore[arg-type]  # the old switch, refused with the fix
    with pytest.raises(ConfigurationError, match="local"):
        ExactResume(mtbf=None, memory_tier=MemoryTierOptions(dir="s3://bucket/shm"))
