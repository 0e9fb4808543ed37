"""The pure parts of ``prove``'s runs: where B is killed, how the command is made to work from a run's own
directory, what is cleaned after an exact verdict, and the clear refusals when a script cannot be proved."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_resume.prove import files
from lightning_resume.prove.runner import (
    RunFailed,
    absolute_arguments,
    choose_kill_steps,
    kill_moments,
    remove_checkpoints,
)


def _trace(saves: list[int], last: int = 20) -> dict[int, list[dict]]:
    records: list[dict] = [{"kind": "start", "step": 0}]
    for step in range(last):
        records.append({"kind": "batch", "step": step})
        if step + 1 in saves:
            records.append({"kind": "saved", "step": step + 1})
    return {0: records}


def test_kills_land_after_the_first_checkpoint_in_increasing_order_and_a_seed_repeats_them() -> None:
    steps = choose_kill_steps(_trace([5, 10, 15]), kills=3, seed=7)
    assert steps == sorted(steps) and len(set(steps)) == 3 and min(steps) > 5
    assert choose_kill_steps(_trace([5, 10, 15]), kills=3, seed=7) == steps
    assert choose_kill_steps(_trace([5], last=7), kills=5, seed=0) == [6]  # as many as there are steps


def test_a_script_without_exact_resume_or_without_a_checkpoint_is_refused_saying_so() -> None:
    with pytest.raises(RunFailed, match="no ExactResume callback"):
        choose_kill_steps({}, kills=2, seed=0)
    with pytest.raises(RunFailed, match="saved no checkpoint before its end"):
        choose_kill_steps(_trace([]), kills=2, seed=0)
    with pytest.raises(RunFailed, match="no step after its first checkpoint"):
        choose_kill_steps(_trace([20]), kills=2, seed=0)


def test_arguments_naming_files_become_absolute_and_links_stay_links(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    (tmp_path / "bin").mkdir()
    os.symlink("/usr/bin/env", tmp_path / "bin" / "python")  # like a virtualenv's interpreter
    args = absolute_arguments(["bin/python", "train.py", "--max_steps", "5", "-c", "x.yaml"], tmp_path)
    assert args == [str(tmp_path / "bin" / "python"), str(tmp_path / "train.py"), "--max_steps", "5", "-c", "x.yaml"]


def test_after_an_exact_verdict_only_the_checkpoints_the_runs_wrote_go(tmp_path: Path) -> None:
    (tmp_path / "pretrained").mkdir()
    (tmp_path / "pretrained" / "base.safetensors").write_bytes(b"user")
    run = files.make_run_directory(str(tmp_path / "A"))
    (tmp_path / "A" / "ckpt" / "sharded.distcp").mkdir(parents=True)
    (tmp_path / "A" / "ckpt" / "sharded.distcp" / "__0_0.distcp").write_bytes(b"x")
    (tmp_path / "A" / "ckpt" / "last.ckpt").write_bytes(b"x")
    os.symlink(tmp_path / "pretrained", tmp_path / "A" / "linked")  # a link the run made is not followed
    os.symlink(tmp_path / "pretrained" / "base.safetensors", tmp_path / "A" / "model.safetensors")
    (tmp_path / "A" / "trace").mkdir()
    (tmp_path / "A" / "trace" / "trace-rank0.jsonl").write_text("{}\n")
    (tmp_path / "A" / "launch-1.log").write_text("log")
    remove_checkpoints([run])
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "A", "A/launch-1.log", "A/linked", "A/model.safetensors", "A/trace", "A/trace/trace-rank0.jsonl",
        "pretrained", "pretrained/base.safetensors",
    ]  # fmt: skip


def test_every_other_kill_lands_in_a_validation_when_the_run_validates_after_it() -> None:
    trace = _trace([5, 10])
    assert kill_moments(trace, [6, 8, 12]) == ["batch", "batch", "batch"]  # no validation at all
    trace[0] += [{"kind": "val_start", "step": 10}]
    assert kill_moments(trace, [6, 8, 12]) == ["batch", "val_start", "batch"]
    assert kill_moments(trace, [6, 11]) == ["batch", "batch"]  # no validation at or after step 11
