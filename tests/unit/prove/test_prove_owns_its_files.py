"""``prove`` touches only what its own runs made: after an EXACT verdict the user's files under the workdir
(a pretrained model, features, an older run's checkpoint) are all still there, only the checkpoints the runs
wrote in the run directories prove created are gone; an existing run directory is refused, not emptied; a
trainee that leaves a FIFO in place of its trace gets a named refusal, not a hang.

The command proved is a small script that records the trace ``ExactResume`` would (docs/prove.md) for a
30-step "training" whose state is its step, saved every 5 steps to ``ckpt/last.ckpt`` and resumed from it:
``prove``'s runs, kills and comparison are the real ones, with no torch to import in each launch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lightning_resume.prove.runner import ProveOptions, RunFailed, prove

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

SCRIPT = """
import json, os, sys, time

trace = os.path.join(os.environ["LIGHTNING_RESUME_TRACE"], "trace-rank0.jsonl")
if sys.argv[1:] == ["fifo"]:
    os.mkfifo(trace)  # what a hostile or broken trainee can leave in place of its trace
    sys.exit(0)
ckpt = os.path.join("ckpt", "last.ckpt")
begin = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
os.makedirs("ckpt", exist_ok=True)
fd = os.open(trace, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)


def record(**fields):
    os.write(fd, (json.dumps(fields) + "\\n").encode())


record(kind="start", step=begin, resumed_from=ckpt if begin else None, exact=True, problems=[], findings=[])
for step in range(begin, 30):
    record(kind="batch", step=step, micro=step, epoch=0, batch=f"b{step}", rng=f"r{step}", loss=f"{step:08x}")
    if (step + 1) % 5 == 0:
        record(kind="saved", step=step + 1, params=f"p{step + 1}", optim="o")  # recorded before it is durable
        with open(ckpt + ".tmp", "w") as f:
            f.write(str(step + 1))
        os.replace(ckpt + ".tmp", ckpt)
    time.sleep(0.05)  # a step's work: the kill poll sees each step
record(kind="end", step=30, params="p30", optim="o", files=["last.ckpt"])
"""


def _options(tmp_path: Path, workdir: Path, *args: str) -> ProveOptions:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return ProveOptions(command=[sys.executable, str(script), *args], workdir=workdir, kills=1, seed=0, timeout_s=120)


def test_an_exact_proof_removes_only_the_checkpoints_its_runs_wrote(tmp_path: Path) -> None:
    work = tmp_path / "project"
    users = {
        "pretrained/base-model.safetensors": b"weights",
        "data/features.pt": b"features",
        "old-run/epoch=1-step=100.ckpt": b"an older run",
        "notes.txt": b"notes",
    }
    for name, data in users.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_bytes(data)
    verdict = prove(_options(tmp_path, work))
    assert verdict.exact and verdict.launches == {0: 2}, verdict
    assert {name: (work / name).read_bytes() for name in users} == users
    assert not list(work.rglob("last.ckpt")), "the runs' own checkpoints are removed"
    assert (work / "B" / "trace" / "trace-rank0.jsonl").is_file() and (work / "B" / "launch-2.log").is_file()


def test_an_existing_run_directory_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / "B" / "ckpt").mkdir(parents=True)
    (work / "B" / "ckpt" / "mine.ckpt").write_bytes(b"mine")
    with pytest.raises(RunFailed, match="B already exists; prove never reuses or deletes what it did not create"):
        prove(_options(tmp_path, work))
    assert (work / "B" / "ckpt" / "mine.ckpt").read_bytes() == b"mine"


def test_a_fifo_left_in_place_of_the_trace_is_named_not_read(tmp_path: Path) -> None:
    with pytest.raises(RunFailed, match="A: its trace cannot be read: .*trace-rank0.jsonl is not a regular file"):
        prove(_options(tmp_path, tmp_path / "work", "fifo"))
