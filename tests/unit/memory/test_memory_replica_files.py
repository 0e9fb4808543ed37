"""Replica files in a holder's slot: written as snapshots are (new temporary 0600 relative to the slot, atomic
rename), byte for byte the owner's file, verified when read (digests, the owner's rank, world size and run),
refused when they are not, and removed by a clean end or a stale-slot cleanup."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.format.atomic import owner_token
from lightning_resume.memory import store as memory_store
from lightning_resume.memory.store import MemoryStore, NotEnoughSharedMemory, memory_root, replica_name
from tests.helpers.memory_oracles import load_replica

K = "0123456789abcdef"


def _state(step: int) -> dict:
    return {"global_step": step, "w": torch.arange(1000, dtype=torch.float32) + step, "loops": {"x": step}}


def _chunks(data: bytes, size: int = 999) -> Iterator[memoryview]:
    view = memoryview(data)
    return (view[i : i + size] for i in range(0, len(data), size))


def _node(tmp_path: Path, name: str, rank: int) -> MemoryStore:
    """Rank ``rank`` of 2 with a memory dir of its own (one node each)."""
    return MemoryStore(memory_root(str(tmp_path / name)), K, rank=rank, world_size=2)


def _owner_file(tmp_path: Path, rank: int = 0, step: int = 5, run: str = "r") -> bytes:
    owner = _node(tmp_path, f"owner{rank}", rank)
    owner.save(_state(step), step=step, seq=3, run=run)
    owner.wait()
    return Path(owner.path).read_bytes()


def test_a_received_replica_is_the_owners_file_and_loads_verified(tmp_path: Path) -> None:
    data = _owner_file(tmp_path)
    holder = _node(tmp_path, "holder", 1)
    path = holder.write_received(replica_name(0, 2), len(data), _chunks(data))
    assert path == holder.replica_path(0) == os.path.join(holder.directory, "replica-0-of-2.safetensors")
    assert Path(path).read_bytes() == data and (os.stat(path).st_mode & 0o777) == 0o600
    snap = load_replica(holder, 0, "r")
    assert snap is not None and (snap.step, snap.seq) == (5, 3) and torch.equal(snap.checkpoint["w"], _state(5)["w"])
    assert holder.replica_owners() == [0] and holder.load("r") is None  # a replica is not the holder's own
    assert load_replica(holder, 1, "r") is None


def test_a_replica_corrupted_on_the_holder_is_refused_by_digest(tmp_path: Path) -> None:
    data = bytearray(_owner_file(tmp_path))
    data[-10] ^= 0x01  # one bit of the last tensor's bytes
    holder = _node(tmp_path, "holder", 1)
    holder.write_received(replica_name(0, 2), len(data), _chunks(bytes(data)))
    with pytest.raises(CheckpointCorruptError, match="replica-0-of-2.safetensors"):
        load_replica(holder, 0, "r")


def test_a_replica_that_claims_another_rank_or_run_is_refused(tmp_path: Path) -> None:
    rank1 = _owner_file(tmp_path, rank=1)  # rank 1's own file, put where rank 0's replica goes
    holder = _node(tmp_path, "holder", 1)
    holder.write_received(replica_name(0, 2), len(rank1), _chunks(rank1))
    with pytest.raises(CheckpointCorruptError, match="not rank 0's memory-tier snapshot") as err:
        load_replica(holder, 0, "r")
    assert err.value.actual["rank"] == 1  # type: ignore[index]
    holder.write_received(replica_name(0, 2), len(data := _owner_file(tmp_path)), _chunks(data))
    with pytest.raises(CheckpointCorruptError, match="not rank 0's"):
        load_replica(holder, 0, "another run")


def test_a_short_stream_leaves_the_previous_replica_and_no_temporary(tmp_path: Path) -> None:
    data = _owner_file(tmp_path)
    holder = _node(tmp_path, "holder", 1)
    holder.write_received(replica_name(0, 2), len(data), _chunks(data))
    with pytest.raises(CheckpointCorruptError, match="not the size announced"):
        holder.write_received(replica_name(0, 2), len(data) + 1, _chunks(data))
    assert Path(holder.replica_path(0)).read_bytes() == data
    assert sorted(os.listdir(holder.directory)) == ["rank-1-of-2.owner", "replica-0-of-2.safetensors"]


def test_a_replica_that_does_not_fit_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _owner_file(tmp_path)
    holder = _node(tmp_path, "holder", 1)
    monkeypatch.setattr(memory_store, "free_bytes", lambda directory: 100)
    with pytest.raises(NotEnoughSharedMemory, match="replica-0-of-2.safetensors needs .* 0.0 MiB free") as err:
        holder.write_received(replica_name(0, 2), len(data), _chunks(data))
    assert (err.value.needed, err.value.free) == (len(data), 100)
    assert holder.replica_owners() == [] and not os.path.exists(holder.replica_path(0))


@pytest.mark.parametrize(
    "name", ["../rank-1-of-2.safetensors", "replica-0-of-3.safetensors", "rank-0-of-2.safetensors"]
)
def test_only_this_ranks_own_name_or_a_replica_of_its_world_is_written(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="neither rank-1-of-2.safetensors nor a replica"):
        _node(tmp_path, "holder", 1).write_received(name, 3, _chunks(b"abc"))


def test_a_snapshot_received_as_the_ranks_own_file_loads_as_its_own(tmp_path: Path) -> None:
    """Recovery installs a holder's replica as the owner's own snapshot on a replaced node."""
    data = _owner_file(tmp_path)
    fresh = _node(tmp_path, "replaced", 0)
    fresh.write_received(fresh.name, len(data), _chunks(data))
    snap = fresh.load("r")
    assert snap is not None and snap.step == 5


@pytest.mark.parametrize("asynchronous", [True, False])
def test_after_commit_gets_the_committed_file_open(tmp_path: Path, asynchronous: bool) -> None:
    store = MemoryStore(memory_root(str(tmp_path)), K, rank=0, world_size=1, asynchronous=asynchronous)
    got: list = []

    def after(fd: int, step: int, seq: int) -> None:
        with os.fdopen(fd, "rb") as f:
            got.append((f.read(), step, seq))

    store.save(_state(1), step=1, seq=1, run="r", after_commit=after)
    store.save(_state(2), step=2, seq=2, run="r")  # not handed over
    store.wait()
    first = got[0][0]
    store.save(_state(3), step=3, seq=3, run="r", after_commit=after)
    store.wait()
    assert [(step, seq) for _, step, seq in got] == [(1, 1), (3, 3)]
    assert got[1][0] == Path(store.path).read_bytes() and first != got[1][0]


def test_a_clean_end_removes_the_replicas_held_too(tmp_path: Path) -> None:
    data = _owner_file(tmp_path)
    holder = _node(tmp_path, "holder", 1)
    holder.save(_state(5), step=5, seq=3, run="r")
    holder.write_received(replica_name(0, 2), len(data), _chunks(data))
    holder.free()
    assert os.listdir(holder.root) == []


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_stale_slot_holding_replicas_is_cleaned_up(tmp_path: Path) -> None:
    root = Path(memory_root(str(tmp_path)))
    root.mkdir(mode=0o700, parents=True)
    stale = root / ("a" * 16)
    stale.mkdir(mode=0o700)
    (stale / "replica-0-of-2.safetensors").write_bytes(b"x")
    (stale / ".replica-0-of-2.safetensors.tmp-0123456789ab-12-0123abcd").write_bytes(b"x")
    (stale / "rank-1-of-2.owner").write_text(f"{owner_token()} {_dead_pid()}")
    old = time.time() - 2 * memory_store.STALE_AFTER_S
    for p in stale.iterdir():
        os.utime(p, (old, old))
    assert MemoryStore(str(root), K, rank=1, world_size=2).clean_stale() == [str(stale)]
