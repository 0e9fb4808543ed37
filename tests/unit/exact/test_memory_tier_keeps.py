"""The memory tier's kept saves (``memory.store``): a save every holder stored is kept as a hard link
(``<name>.keep-<seq>.safetensors``) that outlives the next commit over its name, is pruned below the anchor,
read by its header, made current again for a recovery, freed at a clean end and cleaned up with a stale slot."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.format.atomic import owner_token
from lightning_resume.memory import store as memory_tier
from lightning_resume.memory.store import Kept, MemoryStore, keep_name, replica_name

K = "0123456789abcdef"


def _store(tmp_path: Path, rank: int = 0, world_size: int = 2) -> MemoryStore:
    return MemoryStore(memory_tier.memory_root(str(tmp_path)), K, rank, world_size, asynchronous=False)


def _state(step: int) -> dict:
    return {"global_step": step, "w": torch.arange(6, dtype=torch.float32) + step}


def _slot(tmp_path: Path) -> Path:
    return Path(memory_tier.memory_root(str(tmp_path))) / K


def test_keep_names_say_whose_save_it_is() -> None:
    assert keep_name("rank-0-of-2.safetensors", 4) == "rank-0-of-2.keep-4.safetensors"
    assert keep_name(replica_name(1, 2), 12) == "replica-1-of-2.keep-12.safetensors"


def test_a_kept_save_is_a_link_that_outlives_the_next_commit(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.save(_state(8), step=8, seq=4, run="r")
    kept = store.keep(store.name, 4)
    slot = _slot(tmp_path)
    assert os.stat(slot / kept).st_ino == os.stat(slot / store.name).st_ino  # free: the same file
    store.save(_state(10), step=10, seq=5, run="r")
    assert os.stat(slot / kept).st_ino != os.stat(slot / store.name).st_ino
    assert store.kept() == [Kept(kept, store.name, 0, 4)]
    snap = store.check_kept(store.kept()[0], "r")  # header only
    assert (snap.step, snap.seq, snap.checkpoint) == (8, 4, {})
    current = store.load("r")
    assert current is not None and current.step == 10


def test_prune_removes_the_keeps_below_the_anchor_of_this_rank_and_its_owners_only(tmp_path: Path) -> None:
    mine, neighbour = _store(tmp_path, 0), _store(tmp_path, 1)  # two ranks of one node share the slot
    for seq in (3, 4, 5):
        mine.save(_state(2 * seq), step=2 * seq, seq=seq, run="r")
        mine.keep(mine.name, seq)
        neighbour.save(_state(2 * seq), step=2 * seq, seq=seq, run="r")
        neighbour.keep(neighbour.name, seq)
    mine.write_received(replica_name(1, 2), 3, iter([memoryview(b"abc")]))  # stands for rank 1's replica here
    mine.keep(replica_name(1, 2), 3)
    assert mine.prune(4, owners=[1]) == ["rank-0-of-2.keep-3.safetensors", "replica-1-of-2.keep-3.safetensors"]
    assert [k.seq for k in mine.kept([1])] == [4, 5]
    assert [k.seq for k in neighbour.kept()] == [3, 4, 5]  # another rank's keeps are its own to prune
    assert mine.prune(None) == ["rank-0-of-2.keep-4.safetensors", "rank-0-of-2.keep-5.safetensors"]


def test_a_kept_save_is_made_current_again(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.save(_state(8), step=8, seq=4, run="r")
    kept = store.keep(store.name, 4)
    store.save(_state(10), step=10, seq=5, run="r")
    store.reinstate(kept)
    snap = store.load("r")
    assert snap is not None and (snap.step, snap.seq) == (8, 4)
    assert torch.equal(snap.checkpoint["w"], _state(8)["w"])
    with pytest.raises(ValueError, match="not a kept save of rank-0-of-2"):
        store.reinstate("replica-1-of-2.keep-3.safetensors")


def test_a_kept_save_whose_record_is_not_its_name_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.save(_state(8), step=8, seq=4, run="r")
    store.keep(store.name, 5)  # the record inside says save 4
    with pytest.raises(CheckpointCorruptError, match="not the kept save its name says"):
        store.check_kept(store.kept()[0], "r")
    store.keep(store.name, 4)
    with pytest.raises(CheckpointCorruptError):
        store.check_kept(store.kept()[0], "another run")


def test_a_clean_end_frees_the_kept_saves_too(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.save(_state(8), step=8, seq=4, run="r")
    store.keep(store.name, 4)
    store.write_received(replica_name(1, 2), 3, iter([memoryview(b"abc")]))
    store.keep(replica_name(1, 2), 2)
    store.free()
    assert not _slot(tmp_path).exists()


def test_a_stale_slot_with_kept_saves_is_cleaned_up(tmp_path: Path) -> None:
    old = _store(tmp_path)
    old.save(_state(8), step=8, seq=4, run="r")
    old.keep(old.name, 4)
    old.close()
    owner = _slot(tmp_path) / "rank-0-of-2.owner"
    owner.write_text(f"{owner_token()} 999999999")  # a process that is gone
    then = time.time() - 2 * memory_tier.STALE_AFTER_S
    for path in _slot(tmp_path).iterdir():
        os.utime(path, (then, then))
    other = MemoryStore(memory_tier.memory_root(str(tmp_path)), "f" * 16, 0, 2, asynchronous=False)
    assert other.clean_stale() == [str(_slot(tmp_path))]
