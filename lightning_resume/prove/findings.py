"""What ``ExactResume`` found that defeats exactness, as records with a kind: the evidence ``prove`` diagnoses from.

Each problem is recorded when it is found, where it is computed (the walk for unsaved generators, the loader
checks, the restore), with a ``kind`` from ``KINDS``, the ``subject`` it is about (an object path such as
``model.noise``, a loader's name, a buffer's name) and the ``line`` the user was told. ``prove.compare`` maps
kinds to causes and fixes and never reads the words of a line. Pure data: no torch, no Lightning, so the
comparison stays importable without them; building findings from a run is ``exact.evidence``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

UNSAVED_GENERATOR = "unsaved_generator"
"""A ``torch.Generator``/``numpy`` generator/``random.Random`` reachable from the model or data that no
checkpoint saves; ``subject``: its object path."""
LOADER_POSITION_UNSAVED = "loader_position_unsaved"
"""A train loader whose position ExactResume cannot save (a DataLoader subclass, a batch sampler without
state, not a DataLoader); ``subject``: the loader's name."""
LOADER_CONFIG = "loader_config"
"""A loader configuration that defeats exactness (shared generator, worker RNG not saved, wrapped sampler)."""
UNSAVED_BUFFER = "unsaved_buffer"
"""A non-persistent buffer that differed right after a restore; ``subject``: its name."""
MID_STEP_CAPTURE = "mid_step_capture"
"""The checkpoint resumed from was captured inside a step or a validation, not at a step boundary."""
WORLD_SIZE = "world_size"
"""The relaunch runs on another world size than the checkpoint's; ``subject``: ``"<saved> -> <now>"``."""
USER_STATE = "user_state"
"""State the user keeps that ExactResume cannot capture; ``subject``: its object path."""
NONDETERMINISTIC_KERNELS = "nondeterministic_kernels"
"""CUDA kernels not in deterministic mode: two runs can differ without any resume."""
WALL_CLOCK_STOP = "wall_clock_stop"
"""Training stops on wall-clock time (``max_time``)."""
LAUNCHER = "launcher"
"""A launcher setting that defeats exact resumes (torchelastic restarts)."""
RESUME_DIFFERENCE = "resume_difference"
"""Any other way the checkpoint did not fit the relaunch, as ``restore`` reported it (``strict=False``)."""

KINDS = frozenset({
    UNSAVED_GENERATOR, LOADER_POSITION_UNSAVED, LOADER_CONFIG, UNSAVED_BUFFER, MID_STEP_CAPTURE, WORLD_SIZE,
    USER_STATE, NONDETERMINISTIC_KERNELS, WALL_CLOCK_STOP, LAUNCHER, RESUME_DIFFERENCE,
})  # fmt: skip
"""Every kind this version records; a trace from a newer writer may hold others (kept, named as they are)."""


@dataclass(frozen=True)
class Finding:
    """One problem: its ``kind`` (``KINDS``), what it is about (``subject``), the ``line`` shown to the user."""

    kind: str
    subject: str
    line: str

    def to_record(self) -> dict[str, str]:
        return {"kind": self.kind, "subject": self.subject, "line": self.line}


def from_records(records: Any) -> tuple[Finding, ...]:
    """The findings of a ``start`` record's ``findings`` field; an entry that is not a finding is skipped."""
    if not isinstance(records, (list, tuple)):
        return ()
    out = []
    for r in records:
        if isinstance(r, Mapping) and isinstance(r.get("kind"), str):
            out.append(Finding(r["kind"], str(r.get("subject", "")), str(r.get("line", ""))))
    return tuple(out)


def of_kind(findings: Iterable[Finding], *kinds: str) -> list[Finding]:
    """The findings whose kind is one of ``kinds``, in order."""
    return [f for f in findings if f.kind in kinds]
