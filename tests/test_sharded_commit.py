"""Commit marker, verification, "newest committed" and stale cleanup of sharded checkpoint directories."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.sharded import (
    clean_uncommitted,
    load_full,
    load_meta,
    load_sharded,
    newest_committed,
    save_sharded,
    verify_sharded,
)
from lightning_resume.sharded import commit as commits
from lightning_resume.sharded.meta import UnencodableStateError, decode, encode

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((3, 2), value), "b": torch.arange(4)}, "step": int(value)}


def _save(root, name: str, step: int) -> str:
    return save_sharded(_state(float(step)), str(root / name), step=step, meta={"global_step": step})


def test_round_trip_and_marker_lists_every_file_with_digest(tmp_path):
    directory = _save(tmp_path, "step-3", 3)
    record = verify_sharded(directory)
    on_disk = set(os.listdir(directory)) - {commits.MARKER}
    assert record.step == 3 and record.world_size == 1 and set(record.files) == on_disk
    assert commits.IN_PROGRESS not in on_disk
    template = _state(0.0)
    load_sharded(template, directory)
    assert torch.equal(template["model"]["w"], torch.full((3, 2), 3.0)) and template["step"] == 3
    assert load_meta(directory) == {"global_step": 3}


@pytest.mark.parametrize("damage", ["marker", "missing", "truncated", "flipped"])
def test_damaged_directory_is_refused_naming_the_file(tmp_path, damage):
    directory = _save(tmp_path, "step-1", 1)
    shard = os.path.join(directory, "__0_0.distcp")
    if damage == "marker":
        os.remove(os.path.join(directory, commits.MARKER))
    elif damage == "missing":
        os.remove(shard)
    elif damage == "truncated":
        os.truncate(shard, os.path.getsize(shard) - 1)
    else:
        data = bytearray(open(shard, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(shard, "wb").write(bytes(data))
    expected = "COMMITTED" if damage == "marker" else "__0_0.distcp"
    with pytest.raises(CheckpointCorruptError, match=expected):
        verify_sharded(directory)
    with pytest.raises(CheckpointCorruptError, match=expected):
        load_sharded(_state(0.0), directory)
    with pytest.raises(CheckpointCorruptError, match=expected):
        load_full(directory)


def test_newest_committed_skips_uncommitted_and_corrupt_and_cleanup_removes_only_ours(tmp_path):
    _save(tmp_path, "step-2", 2)
    newest = _save(tmp_path, "step-4", 4)
    broken = _save(tmp_path, "step-6", 6)
    os.truncate(os.path.join(broken, "__0_0.distcp"), 10)
    commits.begin(str(tmp_path / "step-8"))  # a save that died before its marker
    (tmp_path / "user-dir").mkdir()  # not ours: never touched
    assert newest_committed(str(tmp_path)) == newest
    assert clean_uncommitted(str(tmp_path)) == [str(tmp_path / "step-8")]
    assert sorted(os.listdir(tmp_path)) == ["step-2", "step-4", "step-6", "user-dir"]
    assert newest_committed(str(tmp_path / "nothing-here")) is None


def test_rewriting_a_directory_uncommits_it_first(tmp_path):
    directory = _save(tmp_path, "last", 1)
    commits.begin(directory)  # what a save over an existing checkpoint does first
    with pytest.raises(CheckpointCorruptError, match="no COMMITTED"):
        verify_sharded(directory)
    assert newest_committed(str(tmp_path)) is None


_records = st.lists(st.tuples(st.integers(0, 5), st.floats(0, 10)), min_size=1, max_size=8)


@given(_records)
def test_pick_newest_is_the_highest_step_then_latest_commit(rows):
    records = [commits.CommitRecord(f"d{i}", step, 1) for i, (step, _) in enumerate(rows)]
    mtimes = {f"d{i}": t for i, (_, t) in enumerate(rows)}
    best = commits.pick_newest(records, mtimes)
    assert all((r.step, mtimes[r.path]) <= (best.step, mtimes[best.path]) for r in records)


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**62, 2**62), st.floats(allow_nan=False), st.text(max_size=5))
_tree = st.recursive(_leaf, lambda kids: st.one_of(
    st.lists(kids, max_size=3), st.tuples(kids, kids),
    st.dictionaries(st.one_of(st.text(max_size=4), st.integers(0, 9)), kids, max_size=3)), max_leaves=12)


@settings(max_examples=60, deadline=None)
@given(_tree)
def test_meta_codec_round_trips_plain_trees_exactly(tree):
    encoded, tensors = encode(tree)
    assert decode(encoded, tensors) == tree and not tensors


def test_meta_codec_keeps_tensors_arrays_and_special_floats_and_refuses_objects(tmp_path):
    rng = np.random.default_rng(0).bit_generator.state
    tree = {"rng": torch.get_rng_state(), "np": np.arange(3, dtype=np.uint32), "f": (float("inf"), np.float32(1.5)),
            "state": rng}
    encoded, tensors = encode(tree)
    back = decode(encoded, tensors)
    assert torch.equal(back["rng"], tree["rng"]) and back["np"].dtype == np.uint32
    assert back["f"] == (float("inf"), np.float32(1.5)) and type(back["f"][1]) is np.float32
    assert back["state"] == rng
    with pytest.raises(UnencodableStateError, match="hyper_parameters.loss"):
        encode({"hyper_parameters": {"loss": torch.nn.MSELoss()}})
