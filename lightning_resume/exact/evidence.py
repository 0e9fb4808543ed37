"""What ``ExactResume`` finds that defeats exactness in a run, each as a ``prove.findings.Finding`` with its kind.

The checks themselves live where they belong (``state.limits``, ``state.data``, ``launchers``, ``restore``);
this module calls them one by one so that each line the user is warned about carries the kind of problem
and the object it is about, as found: ``lightning-resume prove`` diagnoses from these, never from words.
Lines are the ones the user sees; gathering them is all this module does (no warning, no file).
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Timer

from lightning_resume.exact.launchers import torchelastic_problem
from lightning_resume.exact.restore import ResumeReport, capture_point_problem
from lightning_resume.exact.state import limits
from lightning_resume.exact.state.data import loader_problems, unsaved_position
from lightning_resume.prove import findings as kinds
from lightning_resume.prove.findings import Finding


def cannot_be_exact(
    trainer: pl.Trainer,
    loaders: list,
    roots: Mapping[str, Any],
    saved: Iterable[Any],
    unsaveable: Iterable[tuple[str, str]] = (),
) -> list[Finding]:
    """One finding per loader configuration, unsaved random stream, state that cannot be saved or launcher
    setting that defeats exactness, in the order they are warned about. ``roots``: where state lives (module,
    datamodule, datasets); ``saved``: the generators and objects a checkpoint saves; ``unsaveable``: ``(path, line)``
    of state found but not saveable (``state.user``)."""
    out = [
        Finding(kinds.LOADER_CONFIG, f"train loader {i}", f"resume will not be exact: {p}")
        for i, dl in enumerate(loaders)
        for p in loader_problems(f"train loader {i}", dl)
    ]
    unsaved = limits.unsaved_generator_paths(roots, saved)
    out += [Finding(kinds.UNSAVED_GENERATOR, path, f"not exact: {line}") for path, line in unsaved]
    out += [Finding(kinds.USER_STATE, path, f"not exact: {line}") for path, line in unsaveable]
    kernels = limits.nondeterministic_kernels(trainer.strategy.root_device)
    if kernels is not None:
        out.append(Finding(kinds.NONDETERMINISTIC_KERNELS, str(trainer.strategy.root_device), f"not exact: {kernels}"))
    has_timer = any(isinstance(cb, Timer) for cb in trainer.callbacks)  # type: ignore[attr-defined]
    stop = limits.wall_clock_stop(has_timer)
    if stop is not None:
        out.append(Finding(kinds.WALL_CLOCK_STOP, "Timer", f"not exact: {stop}"))
    launcher = torchelastic_problem(os.environ)
    return out + ([Finding(kinds.LAUNCHER, "torchelastic", launcher)] if launcher is not None else [])


def unsaved_positions(loaders: list) -> list[Finding]:
    """Each train loader whose position cannot be saved (``data.unsaved_position``)."""
    named = ((f"train loader {i}", dl) for i, dl in enumerate(loaders))
    return [
        Finding(kinds.LOADER_POSITION_UNSAVED, name, line)
        for name, dl in named
        if (line := unsaved_position(name, dl)) is not None
    ]


def after_restore(
    trainer: pl.Trainer, pending: Optional[Mapping[str, Any]], report: ResumeReport, known: Iterable[str] = ()
) -> list[Finding]:
    """What the restore of ``pending`` reported, by kind: non-persistent buffers that differ, a checkpoint
    captured mid-step, another world size, and each other difference line (``known``: lines already given a
    kind, such as the unsaved loader positions, left out)."""
    if pending is None:
        return []
    out = [Finding(kinds.UNSAVED_BUFFER, str(name), f"non-persistent buffer {name} differs after restore")
           for name in report.unsaved_buffers_differ]  # fmt: skip
    mid_step = capture_point_problem(pending)
    if mid_step is not None:
        out.append(Finding(kinds.MID_STEP_CAPTURE, str(pending.get("captured_at")), mid_step))
    saved_world = pending.get("world_size")
    if saved_world is not None and saved_world != trainer.world_size:
        subject = f"{saved_world} -> {trainer.world_size}"
        out.append(Finding(kinds.WORLD_SIZE, subject, f"world size {subject} (checkpoint -> this run)"))
    given = {f.line for f in out} | set(known)
    rest = [line for line in report.differences if line not in given]
    return out + [Finding(kinds.RESUME_DIFFERENCE, "", str(line)) for line in rest]
