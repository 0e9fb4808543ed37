"""Test-side pacing of the replicated memory tier: each memory snapshot the schedule replicates first waits until
this rank's replicator is idle (the previous transfer acknowledged). Every rank then votes idle at the gate
(``memory.replicate.agree``), so every such snapshot is replicated, whatever this machine's speed, and a test can
wait for the replica of a given step. Patched in a job's own process; the product has no such hook."""

from __future__ import annotations

import time
from typing import Any

IDLE_TIMEOUT_S = 120.0
"""How long a snapshot waits for the previous transfer: past it, the gate decides as it would in production."""


def wait_replicated() -> None:
    """From now on in this process, ``agree`` first waits for an idle replicator (a transfer held forever by a
    test is waited for ``IDLE_TIMEOUT_S`` only when a later snapshot comes, which the tests avoid)."""
    from lightning_resume.memory import replicate

    agree = replicate.agree

    def patient(replicator: Any) -> bool:
        replicator.store.wait()  # the previous snapshot handed over to the replicator
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while replicator.vote().busy and time.monotonic() < deadline:
            time.sleep(0.01)
        return agree(replicator)

    replicate.agree = patient
