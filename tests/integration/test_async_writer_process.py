"""``writer="process"``: real SIGKILLs of the trainer and of its writer process during a durable write.

A child trainer saves ``last.ckpt`` in a loop (``jobs/async_writer_process_loop.py``). The test waits for
a temporary of ``last.ckpt`` made by a process other than the trainer (the writer: temporaries carry
their writer's pid), freezes that writer with SIGSTOP and checks the temporary is still there, so the
kill lands during a write, then:

- kills the **trainer** and lets the writer go on: the writer alone completes and commits the write the
  trainer handed it (a verified file of that step, which the trainer never saw end), then exits;
- kills the **writer**: the trainer's next save raises ``AsyncWriteError`` naming the writer's pid and the
  file, the temporary is gone and ``last.ckpt`` is the previous checkpoint, whole.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from lightning_resume import SafetensorsCheckpointIO
from tests.helpers import processes
from tests.helpers.paths import job_script

N = 4_000_000  # 16 MB: each write takes tens of milliseconds, and the loop keeps the writer busy
TIMEOUT = 90.0


def _events(out: Path) -> list[tuple[str, str]]:
    path = out / "events"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(kind, rest) for kind, _, rest in (line.partition(" ") for line in lines if line.strip())]


def _steps(out: Path, kind: str) -> list[int]:
    return [int(rest) for k, rest in _events(out) if k == kind]


def _temporaries(out: Path) -> dict[str, int]:
    """``last.ckpt``'s temporaries in ``out``, with the pid of the process that made each."""
    found = {}
    for name in os.listdir(out):
        match = re.match(r"^\.last\.ckpt\.tmp-[0-9a-f]{12}-(\d+)-[0-9a-f]{8}$", name)
        if match:
            found[name] = int(match[1])
    return found


def _freeze_writer_mid_write(proc, out: Path) -> tuple[int, str]:
    """After the first durable write, SIGSTOP the first process other than ``proc`` seen with a temporary of
    ``last.ckpt`` open, once the temporary is still there after the stop: (its pid, the temporary)."""
    deadline = time.monotonic() + TIMEOUT
    while not _steps(out, "end"):
        assert proc.poll() is None and time.monotonic() < deadline, "no durable write"
        time.sleep(0.01)
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the trainer ended"
        for name, pid in _temporaries(out).items():
            assert pid != proc.pid, "the trainer wrote the file itself, not its writer process"
            os.kill(pid, signal.SIGSTOP)
            if (out / name).exists():
                return pid, name
            os.kill(pid, signal.SIGCONT)  # the rename came first: try the next write
        time.sleep(0.001)
    raise AssertionError("never saw the writer mid-write")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"  # a zombie has exited (its reaper is not us)
    except FileNotFoundError:
        return True


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not _gone(pid):
        assert time.monotonic() < deadline, f"writer {pid} still running after its trainer died"
        time.sleep(0.02)


def _start(out: Path):
    out.mkdir()
    return processes.start([job_script("async_writer_process_loop.py"), out / "events", out / "last.ckpt", N])


def _check(out: Path, step: int) -> None:
    loaded = SafetensorsCheckpointIO().load_checkpoint(out / "last.ckpt")  # verifies every checksum
    assert loaded["step"] == step
    assert torch.equal(loaded["w"], torch.full((N,), float(step)))
    assert _temporaries(out) == {}, "a temporary was left"


@pytest.mark.slow
def test_writer_process_commits_after_the_trainer_dies_and_its_own_death_is_named(tmp_path):
    # the trainer dies during a durable write: the writer process completes and commits it alone
    out = tmp_path / "trainer-killed"
    proc = _start(out)
    try:
        writer, _ = _freeze_writer_mid_write(proc, out)
        os.kill(proc.pid, signal.SIGKILL)  # the trainer alone, not its process group
        proc.wait(30)
        in_flight = _steps(out, "begin")[-1]
        assert in_flight not in _steps(out, "end"), "the trainer saw the write it was killed during end"
        os.kill(writer, signal.SIGCONT)
        _wait_gone(writer)  # it finishes, sees the trainer's end of the pipe closed, exits
        _check(out, in_flight)  # the save survived the crash
    finally:
        processes.kill(proc)  # whatever is left of the trainer's group

    # the writer dies during a durable write: a named error, nothing partial, the previous file intact
    out = tmp_path / "writer-killed"
    proc = _start(out)
    try:
        writer, temporary = _freeze_writer_mid_write(proc, out)
        previous = _steps(out, "end")[-1]
        os.kill(writer, signal.SIGKILL)
        assert proc.wait(TIMEOUT) == 3, processes.output(proc)[-processes.TAIL :]
        errors = [rest for kind, rest in _events(out) if kind == "error"]
        assert len(errors) == 1 and f"pid {writer}" in errors[0] and str(out / "last.ckpt") in errors[0], errors
        assert "killed by signal 9" in errors[0], errors[0]
        assert not (out / temporary).exists()
        _check(out, previous)
    finally:
        processes.kill(proc)
