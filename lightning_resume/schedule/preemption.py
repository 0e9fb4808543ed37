"""Preemption signals: handlers that only raise a flag, to be acted on at the next step boundary.

``PreemptionFlag`` installs a handler for each configured signal (default SIGTERM and SIGUSR1,
the signals SLURM and most schedulers send before a kill) that records the signal and returns;
nothing is saved inside the handler. The owner polls ``requested`` at step boundaries, saves, and
stops. ``uninstall`` puts back exactly the handlers that were there, unless someone replaced ours
in the meantime (then theirs is left alone). Handlers can only be set from the main thread of the
main interpreter: elsewhere ``install`` warns and returns ``False``. This module knows nothing of
Lightning or checkpoints.

Chaining: with ``chain=True`` a previous *Python* handler is called after the flag is set (e.g. a
user's logger); ``forward()`` calls it later, once the owner has saved (what ``ExactResume`` does). ``SIG_DFL`` and ``SIG_IGN`` are never "called": the point of the flag is that the
default action (termination) does not happen. Beware that Lightning's own SIGTERM handler (installed
by the Trainer right before the fit loop) makes the loop raise ``SIGTERMException`` at the next
batch, so an owner that wants to save first installs after it and does not chain to it.
"""

from __future__ import annotations

import inspect
import signal
import threading
import warnings
from types import FrameType
from typing import Any, Dict, Iterable, Optional, Sequence, Union

from lightning_resume.errors import PreemptionWarning

SignalLike = Union[int, str, signal.Signals]
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


def parse_signals(names: Iterable[SignalLike]) -> tuple:
    """``["SIGTERM", "usr1", 10]`` -> ``(Signals.SIGTERM, Signals.SIGUSR1, ...)``; ``ValueError`` naming the bad ones."""
    result, bad = [], []
    for item in names:
        try:
            if isinstance(item, str):
                key = item.strip().upper()
                result.append(signal.Signals[key if key.startswith("SIG") else "SIG" + key])
            else:
                result.append(signal.Signals(item))
        except (KeyError, ValueError):
            bad.append(item)
    if bad:
        raise ValueError(f"signals={bad!r} are not signals of this platform; use names like 'SIGTERM', 'SIGUSR1'")
    uncatchable = [s.name for s in result if s.name in ("SIGKILL", "SIGSTOP")]
    if uncatchable:
        raise ValueError(f"signals={uncatchable} cannot be caught; a SIGKILL is survived by the last durable snapshot")
    return tuple(dict.fromkeys(result))


class PreemptionFlag:
    """A flag raised by preemption signals. ``install()`` / ``uninstall()``, or use as a context manager."""

    def __init__(self, signals: Sequence[SignalLike] = DEFAULT_SIGNALS, chain: bool = False) -> None:
        self.signals = parse_signals(signals)
        self.chain = chain
        self._previous: Dict[signal.Signals, Any] = {}
        self._received: Optional[signal.Signals] = None
        self._count = 0

    @property
    def requested(self) -> bool:
        """True once any of the signals has arrived (until ``clear``)."""
        return self._received is not None

    @property
    def received(self) -> Optional[signal.Signals]:
        """The first signal received, for the log line and the exit code (128 + signum is the convention)."""
        return self._received

    @property
    def count(self) -> int:
        return self._count

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def clear(self) -> None:
        self._received = None
        self._count = 0

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        # Runs between two bytecodes of the main thread: set the flag, nothing else of ours.
        if self._received is None:
            self._received = signal.Signals(signum)
        self._count += 1
        previous = self._previous.get(signal.Signals(signum))
        if self.chain and callable(previous):
            previous(signum, frame)

    def forward(self) -> bool:
        """Call the Python handler the received signal had before ours (e.g. Lightning's SIGTERM handler, which
        makes ``fit`` raise ``SIGTERMException``, and any user handler it composes), once the owner has saved:
        what the signal would have done without the flag then happens. ``False`` when there is none to call
        (no signal yet, ``SIG_DFL``, ``SIG_IGN``, or it was already chained)."""
        received = self._received
        previous = self._previous.get(received) if received is not None else None
        if received is None or self.chain or not callable(previous):
            return False
        previous(int(received), inspect.currentframe())
        return True

    def install(self) -> bool:
        """Install the handlers; ``False`` (with a ``PreemptionWarning``) when not on the main thread."""
        if self.installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "preemption handlers not installed: signal handlers can only be set from the main thread; "
                f"{', '.join(s.name for s in self.signals)} will not trigger a snapshot in this process.",
                PreemptionWarning,
                stacklevel=2,
            )
            return False
        try:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError as err:  # e.g. not the main interpreter
            self.uninstall()
            warnings.warn(f"preemption handlers not installed: {err}", PreemptionWarning, stacklevel=2)
            return False
        return True

    def uninstall(self) -> None:
        """Restore the previous handlers, except where ours was already replaced by someone else."""
        for sig, previous in self._previous.items():
            current = signal.getsignal(sig)
            if getattr(current, "__self__", None) is not self:
                continue  # replaced (or already restored) by someone else: theirs stays
            # None means the previous handler was not set from Python: the closest we can restore is SIG_DFL.
            try:
                signal.signal(sig, signal.SIG_DFL if previous is None else previous)
            except ValueError as err:  # not the main thread
                warnings.warn(f"could not restore the {sig.name} handler: {err}", PreemptionWarning, stacklevel=2)
                return
        self._previous = {}

    def __enter__(self) -> PreemptionFlag:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
