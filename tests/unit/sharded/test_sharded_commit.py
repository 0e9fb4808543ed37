"""Commit marker, swap over an existing directory, verification, "newest committed" and stale cleanup."""

from __future__ import annotations

import enum
import os
import pathlib
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lightning.fabric.utilities.data import AttributeDict

from lightning_resume import ShardedSaveError, load_full, load_sharded, newest_committed, save_sharded, verify_sharded
from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.io.verify import verify as verify_file
from lightning_resume.sharded import commit as commits
from lightning_resume.sharded import marker
from lightning_resume.sharded.api import META_FILE, clean_uncommitted, load_meta

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((3, 2), value), "b": torch.arange(4)}, "step": int(value)}


def _save(root, name: str, step: int) -> str:
    return save_sharded(_state(float(step)), str(root / name), step=step, meta={"global_step": step})


def test_round_trip_and_marker_lists_every_file_with_digest(tmp_path):
    directory = _save(tmp_path, "step-3", 3)
    record = verify_sharded(directory)
    on_disk = set(os.listdir(directory)) - {marker.MARKER}
    assert record.step == 3 and record.world_size == 1 and set(record.files) == on_disk
    template = _state(0.0)
    load_sharded(template, directory)
    assert torch.equal(template["model"]["w"], torch.full((3, 2), 3.0)) and template["step"] == 3
    assert load_meta(directory) == {"global_step": 3}


@pytest.mark.parametrize("damage", ["marker", "missing", "truncated", "flipped", "meta"])
def test_damaged_directory_is_refused_naming_the_file(tmp_path, damage):
    directory = _save(tmp_path, "step-1", 1)
    shard = os.path.join(directory, META_FILE if damage == "meta" else "__0_0.distcp")
    if damage == "marker":
        os.remove(os.path.join(directory, marker.MARKER))
    elif damage == "missing":
        os.remove(shard)
    elif damage == "truncated":
        os.truncate(shard, os.path.getsize(shard) - 1)
    else:  # "flipped", "meta": one byte changed, size kept
        data = bytearray(open(shard, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(shard, "wb").write(bytes(data))
    expected = {"marker": "COMMITTED", "meta": META_FILE}.get(damage, "__0_0.distcp")
    with pytest.raises(CheckpointCorruptError, match=expected):
        verify_sharded(directory)
    with pytest.raises(CheckpointCorruptError, match=expected):
        load_sharded(_state(0.0), directory)
    with pytest.raises(CheckpointCorruptError, match=expected):
        load_full(directory)


def test_newest_committed_skips_uncommitted_corrupt_and_staging_and_cleanup_removes_only_ours(tmp_path):
    _save(tmp_path, "step-2", 2)
    newest = _save(tmp_path, "step-4", 4)
    broken = _save(tmp_path, "step-6", 6)
    os.truncate(os.path.join(broken, "__0_0.distcp"), 10)
    staging = commits.stage(str(tmp_path / "step-8"))  # a save that died before its commit
    committed_staging = commits.hidden_sibling(str(tmp_path / "step-9"), marker.STAGING)
    os.rename(_save(tmp_path, "x", 9), committed_staging)  # a save that died after its commit, before its swap
    (tmp_path / "user-dir").mkdir()  # not ours: never touched
    (tmp_path / ".user-hidden").mkdir()
    assert newest_committed(str(tmp_path)) == newest
    removed = clean_uncommitted(str(tmp_path))
    assert removed == [staging]
    assert verify_sharded(str(tmp_path / "step-9")).step == 9  # committed but never swapped in: completed now
    assert not os.path.exists(committed_staging)
    assert sorted(os.listdir(tmp_path)) == [".user-hidden", "step-2", "step-4", "step-6", "step-9", "user-dir"]
    assert newest_committed(str(tmp_path / "nothing-here")) is None


def test_resaving_replaces_the_directory_only_once_the_new_one_is_committed(tmp_path):
    last = _save(tmp_path, "last", 1)
    template = _state(0.0)
    load_sharded(template, last)  # resume from it, then save over it: the resume source itself
    assert save_sharded(_state(2.0), last, step=2, meta={"global_step": 2}) == last
    assert verify_sharded(last).step == 2 and load_meta(last) == {"global_step": 2}
    assert torch.equal(load_full(last)["model"]["w"], torch.full((3, 2), 2.0))
    assert os.listdir(tmp_path) == ["last"]  # no staging or replaced directory left


def test_a_failed_resave_leaves_the_previous_directory_committed(tmp_path, monkeypatch):
    last = _save(tmp_path, "last", 1)
    with pytest.raises(ShardedSaveError, match="hyper_parameters.loss"):
        save_sharded(_state(2.0), last, step=2, meta={"hyper_parameters": {"loss": torch.nn.MSELoss()}})
    with pytest.raises(ShardedSaveError, match=r"failed to write its shards \(rank 0: .*lambda"):
        save_sharded({"model": {"w": torch.ones(2)}, "f": lambda: 0}, last, step=2)  # DCP cannot pickle it
    monkeypatch.setattr(commits, "commit", lambda record: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(ShardedSaveError, match=r"failed to commit \(rank 0: OSError: .*No space left"):
        save_sharded(_state(2.0), last, step=2)  # shards written, marker not: the staging directory goes
    assert verify_sharded(last).step == 1 and load_meta(last) == {"global_step": 1}
    assert os.listdir(tmp_path) == ["last"]


def test_without_atomic_exchange_the_two_rename_swap_still_replaces(tmp_path, monkeypatch):
    monkeypatch.setattr(commits, "_exchange", lambda a, b: False)
    last = _save(tmp_path, "last", 1)
    _save(tmp_path, "last", 2)
    assert verify_sharded(last).step == 2 and os.listdir(tmp_path) == ["last"]


def test_removing_a_directory_renames_it_away_first(tmp_path, monkeypatch):
    last = _save(tmp_path, "last", 1)
    monkeypatch.setattr(commits.shutil, "rmtree", lambda path: (_ for _ in ()).throw(OSError("killed here")))
    with pytest.raises(OSError):
        commits.discard(last)
    assert not os.path.exists(last) and newest_committed(str(tmp_path)) is None  # never a half-deleted "last"
    monkeypatch.undo()
    assert len(clean_uncommitted(str(tmp_path))) == 1 and os.listdir(tmp_path) == []  # deleted ones never return


_records = st.lists(st.tuples(st.integers(0, 5), st.floats(0, 10)), min_size=1, max_size=8)


@given(_records)
def test_pick_newest_is_the_highest_step_then_latest_commit(rows):
    records = [marker.CommitRecord(f"d{i}", step, 1) for i, (step, _) in enumerate(rows)]
    mtimes = {f"d{i}": t for i, (_, t) in enumerate(rows)}
    best = marker.pick_newest(records, mtimes)
    assert all((r.step, mtimes[r.path]) <= (best.step, mtimes[best.path]) for r in records)


class Mode(enum.Enum):
    FAST = "fast"


def test_meta_is_one_io_format_file_and_keeps_every_type(tmp_path):
    meta = {
        "hyper_parameters": AttributeDict(root=pathlib.PosixPath("/data"), dtype=torch.bfloat16, mode=Mode.FAST),
        "order": OrderedDict([("b", 1), ("a", 2)]),
        "shape": torch.Size([2, 3]),
        "rng": torch.get_rng_state(),
        "np": np.arange(3, dtype=np.uint32),
        "f": (float("inf"), np.float32(1.5)),
    }
    directory = save_sharded(_state(1.0), str(tmp_path / "ck"), step=1, meta=meta)
    assert META_FILE in verify_sharded(directory).files and "meta.json" not in os.listdir(directory)
    verify_file(os.path.join(directory, META_FILE))  # the product's own verifier accepts it
    back = load_meta(directory)
    hp = back["hyper_parameters"]
    assert type(hp) is AttributeDict and hp.root == pathlib.PosixPath("/data") and type(hp.root) is pathlib.PosixPath
    assert hp.dtype is torch.bfloat16 and hp.mode is Mode.FAST
    assert type(back["order"]) is OrderedDict and list(back["order"]) == ["b", "a"]
    assert type(back["shape"]) is torch.Size and back["shape"] == torch.Size([2, 3])
    assert torch.equal(back["rng"], meta["rng"]) and back["np"].dtype == np.uint32
    assert back["f"] == (float("inf"), np.float32(1.5)) and type(back["f"][1]) is np.float32
    assert load_meta(save_sharded(_state(1.0), str(tmp_path / "no-meta"), step=1)) is None
