"""``prove`` kills what its launch started, wherever it went, and nothing else: a child in a session of its
own (as torchrun starts its workers) and a daemon whose parent exited are killed with the launch, another
child of ours is not, and a process still running when a launch ended is named (pid and command line) and
killed. Real processes, no training."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lightning_resume.errors import LeftoverProcessWarning
from lightning_resume.prove import reaper, runner

# The launch: a child in a new session that sleeps, and a daemon (new session, its parent exits at once)
# that sleeps; each writes its pid into PIDS; the launch itself sleeps, or exits 0 with END set.
LAUNCH = textwrap.dedent(
    """
    import os, subprocess, sys, time
    pids = sys.argv[1]
    sleeper = [sys.executable, "-c", f"import os, time; open({pids!r} + '/' + str(os.getpid()), 'w'); time.sleep(600)"]
    subprocess.Popen(sleeper, start_new_session=True)
    subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.Popen(sys.argv[1:])", *sleeper],
                     start_new_session=True).wait()
    while len(os.listdir(pids)) < 2:
        time.sleep(0.01)
    if os.environ.get("END") != "1":
        time.sleep(600)
    """
)


def _launch(tmp_path: Path, end: bool) -> tuple[runner._Running, Path]:
    pids = tmp_path / "pids"
    pids.mkdir()
    opts = runner.ProveOptions(command=[], workdir=tmp_path, timeout_s=120, env={"END": "1" if end else "0"})
    running = runner._launch([sys.executable, "-c", LAUNCH, str(pids)], tmp_path, tmp_path / "launch.log", opts)
    deadline = time.monotonic() + 120
    while len(os.listdir(pids)) < 2:  # both sleepers are up
        assert running.proc.poll() is None or end, (tmp_path / "launch.log").read_text()
        assert time.monotonic() < deadline, "the launch never started its children"
        time.sleep(0.01)
    return running, pids


def _survivors(pids: list[int]) -> list[int]:
    """Those of ``pids`` still there (a zombie counts: nobody reaped it); killed, so a failure leaves none."""
    alive = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


def test_a_kill_reaches_a_child_in_its_own_session_and_an_orphaned_daemon_and_nothing_else(tmp_path: Path) -> None:
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    running, pids = _launch(tmp_path, end=False)
    sleepers = [int(name) for name in os.listdir(pids)]
    try:
        running.kill()
        assert bystander.poll() is None, "a process of ours that the launch did not start was killed"
    finally:
        survivors = _survivors(sleepers)
        bystander.kill()
        bystander.wait()
    assert len(sleepers) == 2 and survivors == [], "a process of the killed launch survived"
    assert not reaper.set_subreaper(False), "this process stays a subreaper after the launch (orphans pile up)"


def test_processes_left_running_after_a_launch_ended_are_named_and_killed(tmp_path: Path) -> None:
    running, pids = _launch(tmp_path, end=True)
    sleepers = sorted(int(name) for name in os.listdir(pids))
    try:
        with pytest.warns(LeftoverProcessWarning) as caught:
            running.wait_to_end()
    finally:
        survivors = _survivors(sleepers)
    message = str(caught[0].message)
    assert "2 process(es)" in message and "time.sleep(600)" in message, message
    assert all(f"pid {pid}:" in message for pid in sleepers), message
    assert survivors == [], "a leftover survived the end of prove's launch"
