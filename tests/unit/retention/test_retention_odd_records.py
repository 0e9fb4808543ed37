"""Issue 15 items 10 and 11 (retention and prune): odd saved records, a record of a newer version, two
prunes at once, non-ASCII digits in a rolling name. Each test is the attack."""

from __future__ import annotations

import os
import warnings

import pytest

from lightning_resume import RetentionCheckpoint, RetentionPolicy
from lightning_resume.cli.commands import prune
from lightning_resume.errors import RetentionWarning, TreeFormatError
from lightning_resume.io.resolve import candidates, newest_first, progress, step_in_name
from lightning_resume.retention import records as records_module
from lightning_resume.retention.naming import parse_rolling_name
from lightning_resume.retention.policy import CheckpointRecord


def _record(path: str = "ckpt/step=000000001.ckpt", **extra: object) -> dict:
    return {**CheckpointRecord(path, 1).to_state(), **extra}


def test_a_record_with_a_field_from_a_newer_version_is_read_ignoring_it():
    record = CheckpointRecord.from_state(_record(shard_layout="v9", priority=3))
    assert record.path == "ckpt/step=000000001.ckpt" and record.step == 1


@pytest.mark.parametrize(
    "bad", [1, "x", {"step": 1}, _record(step="1"), _record(tags=[1]), _record(tags=None), _record(verified="yes")]
)
def test_a_record_of_the_wrong_shape_is_a_tree_format_error(bad):
    with pytest.raises(TreeFormatError):
        CheckpointRecord.from_state(bad)


def test_retention_checkpoint_loads_records_of_a_newer_version_and_drops_unreadable_ones(tmp_path):
    callback = RetentionCheckpoint(dirpath=str(tmp_path), retention=RetentionPolicy(keep_last=2))
    state = callback.state_dict()
    good = _record(str(tmp_path / "step=000000001.ckpt"), added_in_v9=True)
    state["retention"] = {"run_id": "r", "records": [good, {"path": 5}, "junk"]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback.load_state_dict(state)
    assert list(callback._records) == [good["path"]]
    assert sum(issubclass(w.category, RetentionWarning) for w in caught) == 2


@pytest.mark.parametrize(
    "state",
    [
        {"retention": [1]},
        {"retention": {"records": "x"}},
        {"retention": {"records": [{"tags": ["anchor"]}, 3, {"path": 1, "tags": 5}]}},
        {"retention": {"records": [{"path": "step=000000001.ckpt", "tags": "anchor"}]}},
        {"current_score": "not a number"},
        {"current_score": [1, 2]},
    ],
)
def test_prune_reads_odd_saved_records_without_crashing(tmp_path, monkeypatch, state):
    for step in (1, 2):
        (tmp_path / f"step={step:09d}.ckpt").write_bytes(b"not a checkpoint")
    monkeypatch.setattr(records_module, "read_checkpoint_callback_state", lambda path, key=None: state)
    found = records_module.records_in(str(tmp_path))
    assert len(found) == 2 and all(r.metric is None and not r.tags for r in found)


def test_a_file_deleted_by_a_concurrent_prune_is_tolerated(tmp_path):
    for step in (1, 2):
        (tmp_path / f"step={step:09d}.ckpt").write_bytes(b"x")
    listed = [e.path for e in candidates(str(tmp_path), (".ckpt",))]
    gone = str(tmp_path / "step=000000001.ckpt")
    os.remove(gone)  # the other prune deleted it between our listing and our look at it
    assert progress(gone) is None and newest_first(listed) == [str(tmp_path / "step=000000002.ckpt")]
    assert [r.path for r in records_module.records_in(str(tmp_path))] == [str(tmp_path / "step=000000002.ckpt")]
    prune._remove(gone)  # already deleted by the other run: the decision is carried out, no FileNotFoundError


def test_the_rolling_name_accepts_only_ascii_digits():
    assert parse_rolling_name("step=١٠٠.ckpt") is None
    assert parse_rolling_name("step=000000100.ckpt") == 100
    assert step_in_name("step=١٠٠-x.ckpt") is None
