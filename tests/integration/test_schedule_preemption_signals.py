"""Preemption handlers, with real signals sent to a real subprocess."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.paths import REPO_ROOT

ROOT = str(REPO_ROOT)

CHILD = textwrap.dedent(
    """
    import signal, sys, time
    from lightning_resume.schedule.preemption import PreemptionFlag
    mode = sys.argv[1]
    chained = []
    def user_handler(signum, frame):
        chained.append(signal.Signals(signum).name)
    if mode == "chain":
        signal.signal(signal.SIGTERM, user_handler)
    flag = PreemptionFlag(chain=(mode == "chain"))
    assert flag.install()
    print("ready", flush=True)
    steps, deadline = 0, time.monotonic() + 300  # liveness only
    while not flag.requested and time.monotonic() < deadline:   # the training loop's step boundaries
        time.sleep(0.005)
        steps += 1
    print("flag", flag.received.name if flag.received else None, "chained", chained, flush=True)
    flag.uninstall()
    expected = user_handler if mode == "chain" else signal.SIG_DFL
    print("restored", signal.getsignal(signal.SIGTERM) is expected, signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL, flush=True)
    if mode == "restore":
        time.sleep(30)  # the parent's second SIGTERM must now kill us with the default action
    """
)


def run_child(mode, signals):
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, mode],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        lines = []
        for sig in signals:
            os.kill(proc.pid, sig)
            if not lines:
                lines = [proc.stdout.readline().strip(), proc.stdout.readline().strip()]
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, lines, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_only_raises_the_flag_and_handlers_are_restored(sig):
    rc, lines, err = run_child("plain", [sig])
    assert rc == 0, err
    assert lines == [f"flag {sig.name} chained []", "restored True True"]


def test_chain_calls_the_previous_python_handler_and_restores_it():
    rc, lines, err = run_child("chain", [signal.SIGTERM])
    assert rc == 0, err
    assert lines == ["flag SIGTERM chained ['SIGTERM']", "restored True True"]


def test_after_uninstall_sigterm_has_its_default_action_again():
    rc, lines, err = run_child("restore", [signal.SIGTERM, signal.SIGTERM])
    assert lines == ["flag SIGTERM chained []", "restored True True"]
    assert rc == -signal.SIGTERM
