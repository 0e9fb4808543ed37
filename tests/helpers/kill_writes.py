"""The kill-during-write harness: run ``jobs/async_save_loop.py`` (async saves of one checkpoint in a loop,
each background write logged as it begins and ends) and SIGKILL it from outside at a chosen moment after
its first durable write. What survives under the final name is the test's to check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from tests.helpers import processes
from tests.helpers.paths import job_script


def events(out: Path) -> list[tuple[str, int]]:
    """The loop's log so far: ``("begin", step)`` and ``("end", step)`` in order."""
    path = out / "events"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(kind, int(step)) for kind, step in (line.split() for line in lines if line.strip())]


def durable_steps(out: Path) -> list[int]:
    """The steps whose background write was committed before the kill."""
    return [step for kind, step in events(out) if kind == "end"]


def kill_during_writes(
    out: Path,
    target: str,
    numel: int,
    delay: float,
    timeout: float = 240,
    env: Optional[dict[str, str]] = None,
    dedupe: bool = False,
) -> str:
    """Save ``numel``-element checkpoints to ``target`` in a loop, logging to ``out/events``; SIGKILL the
    loop ``delay`` s after its first write is durable (``dedupe``: content-addressed saves). The last event: ``"begin"`` when the kill landed
    mid-write."""
    args = [job_script("async_save_loop.py"), out / "events", target, numel] + (["dedupe"] if dedupe else [])
    proc = processes.start(args, env=env)
    processes.kill_when(proc, lambda: bool(durable_steps(out)), timeout, delay=delay)
    return events(out)[-1][0]
