"""``dedupe_job.py`` (a frozen backbone saved with ``dedupe=True``) that SIGKILLs itself inside a pack collection:
``kill_in: "prune"`` (a collection after retention removed a checkpoint) or ``"cleanup"`` (the plugin's cleanup at
its first save into a directory or at the end of the fit), just before the ``kill_at``-th pack it would remove
there (default 1). It prints ``KILLED IN <phase> BEFORE <pack>`` first. The kill hook lives only in this job.
Usage: python dedupe_gc_job.py CONFIG.json (the trainee's config).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repo root holds ``tests``
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from lightning_resume.cas import gc
from lightning_resume.storage import files
from tests.helpers.jobs import dedupe_job


def arm(phase: str, at: int) -> None:
    """Kill this process before the ``at``-th pack removal of a collection in ``phase``."""
    state = {"phase": None, "removed": 0}
    collect, remove = gc.collect, files.remove

    def phased(directory, lineage, keep=frozenset(), temporaries=True):
        callers = {frame.name for frame in traceback.extract_stack()}
        state["phase"] = "cleanup" if callers & {"_clean_before_save", "teardown"} else "prune"
        try:
            return collect(directory, lineage, keep, temporaries)
        finally:
            state["phase"] = None

    def killing_remove(path):
        name = os.path.basename(str(path))
        if state["phase"] == phase and "/blocks/" in str(path) and not name.startswith("."):
            state["removed"] += 1
            if state["removed"] == at:
                print(f"KILLED IN {phase} BEFORE {path}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        return remove(path)

    gc.collect, files.remove = phased, killing_remove


def main(cfg: dict) -> None:
    if cfg.get("kill_in"):
        arm(cfg["kill_in"], int(cfg.get("kill_at", 1)))
    dedupe_job.main(cfg)


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
