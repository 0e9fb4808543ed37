"""Preemption handlers in this process: off the main thread, SIG_IGN restored, a newer handler left alone,
signal names validated. Real signals sent to a real subprocess: tests/integration/test_schedule_preemption_signals.py."""

import signal
import threading

import pytest

from lightning_resume.schedule.preemption import PreemptionFlag, PreemptionWarning, parse_signals


def test_not_on_the_main_thread_warns_and_installs_nothing():
    flag, result = PreemptionFlag(), []
    with pytest.warns(PreemptionWarning, match="main thread"):
        t = threading.Thread(target=lambda: result.append(flag.install()))
        t.start()
        t.join()
    assert result == [False] and not flag.installed
    assert getattr(signal.getsignal(signal.SIGTERM), "__self__", None) is not flag


def test_uninstall_restores_sig_ign_and_leaves_a_newer_handler_alone():
    before_usr1, before_usr2 = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        flag = PreemptionFlag(signals=["usr1", "SIGUSR2"])
        with flag:
            newer = lambda s, f: None
            signal.signal(signal.SIGUSR1, newer)
            signal.raise_signal(signal.SIGUSR2)
            assert flag.received is signal.SIGUSR2 and flag.count == 1
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGUSR1) is newer
        flag.clear()
        assert not flag.requested
    finally:
        signal.signal(signal.SIGUSR1, before_usr1)
        signal.signal(signal.SIGUSR2, before_usr2)


def test_signal_names_are_validated():
    assert parse_signals(["term", signal.SIGUSR1, int(signal.SIGUSR1)]) == (signal.SIGTERM, signal.SIGUSR1)
    with pytest.raises(ValueError, match="SIGBOGUS"):
        parse_signals(["SIGBOGUS"])
    with pytest.raises(ValueError, match="cannot be caught"):
        PreemptionFlag(signals=["SIGKILL"])
