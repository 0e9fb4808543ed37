"""What ``ckpt_path="last"`` resumes from when lightning-resume takes part in the run.

Lightning resolves "last" to the newest ``last*.ckpt`` by modification time, so a run with the default
``ModelCheckpoint()`` (epoch-end saves, no ``save_last``) relaunched with ``ckpt_path="last"`` silently
trains from step 0, and a corrupt newest file is loaded blindly. With ``ExactResume`` in the run (or a
``RetentionCheckpoint`` with a retention rule), "last" is instead the newest checkpoint, by training
progress, that verifies among those the run's checkpoint callbacks write: every candidate
(``io.resolve.candidates``) with a callback's file extension in that callback's directory, for every
checkpoint callback at once, so that Lightning, which asks each callback and then takes the newest file
by time, gets one answer from all of them. A callback that mirrors its files (``Mirrored``) adds its
mirror's checkpoints: the local copy of a checkpoint is read first, its mirror copy only if the local one
is missing or does not verify. Each candidate passed over is named in a warning; the choice,
or that there is none, in one info line.

Candidates are read as the user's ``fit(..., weights_only=...)`` says (``_compat.lightning.fit_weights_only``),
as their load will be: by default a ``torch.save`` file that needs pickled objects (``save_hyperparameters()``
over an ``nn.Module``) is passed over naming them and the fixes, and when that is why every candidate was
passed over, ``NoLoadableCheckpointError`` says so once; with ``weights_only=False`` such a file is a
candidate like any other.

When the trainer's ``CheckpointIO`` hashes every byte as it loads (``protocols.ResolvingCheckpointIO``),
it checks the candidates itself, each by its header only, and falls back along them if the load's hash
fails: a resume reads the checkpoint once. Lightning asks before ``setup`` and before any process group
exists, so no collective runs: every rank reads the same files and reaches the same answer.

When a callback may resume from a memory tier first (``protocols.MemoryFirst``: ``ExactResume`` with
``memory_tier``), each candidate is read only as far as its header here (``io.verify.header_only``: what the
memory tier reads, the run id and step), whatever the ``CheckpointIO``: a resume the memory tier supplies reads
nothing more of durable storage. If it does not supply it, :func:`confirm_last` resolves "last" again as
described above, before anything is loaded, and that answer is restored.

Knows Lightning's checkpoint callbacks (through ``_compat``) and files (through ``io``); decides nothing
about what to keep.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Mapping, Optional, Protocol, runtime_checkable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_resume._compat import lightning as lc
from lightning_resume.errors import NoLoadableCheckpointError, SkippedCheckpointWarning
from lightning_resume.io.resolve import candidates, newest_verified, progress, step_in_name
from lightning_resume.io.verify import header_only, pickled_globals, verify
from lightning_resume.protocols import MemoryFirst, ResolvingCheckpointIO
from lightning_resume.sharded.marker import named_for_lightning
from lightning_resume.storage import files as storage


@dataclass(frozen=True)
class LastChoice:
    """The outcome of resolving ``ckpt_path="last"``: the file (``None``: start from the beginning), the
    directories searched, how many candidates they held, and one line per candidate passed over."""

    path: Optional[str]
    directories: tuple[str, ...]
    considered: int
    skipped: tuple[str, ...]
    pickled: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """When no candidate loads and each is a ``torch.save`` file that needs pickled objects: each one's globals."""
    deferred: bool = False
    """Only the candidates' headers were read: a memory tier is asked first (:func:`confirm_last` follows if not)."""

    def describe(self) -> str:
        where = ", ".join(self.directories) or "no checkpoint directory"
        if self.deferred:
            newest = f"by its header, {self.path}" if self.path else "none"
            return (
                f"ckpt_path='last': the memory tier is asked first; the newest checkpoint in {where}, {newest}, is"
                " verified only if it is what the resume reads"
            )
        if self.path is None:
            return f"ckpt_path='last' found no checkpoint in {where}; training starts from the beginning"
        passed = f", {len(self.skipped)} newer one(s) skipped" if self.skipped else ""
        return (
            f"ckpt_path='last' resumes from {self.path}: the newest of {self.considered} checkpoint(s) in {where}"
            f" (by training progress) that verifies{passed}"
        )


def choose_last(trainer: pl.Trainer, memory_first: Optional[bool] = None) -> LastChoice:
    """Resolve ``ckpt_path="last"`` across the trainer's checkpoint callbacks (see the module docstring).
    ``memory_first``: read the candidates' headers only (default: whether a callback asks a memory tier first)."""
    callbacks = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
    directories: dict[str, None] = {}
    paths: dict[str, None] = {}
    for callback in callbacks:
        directory = lc.checkpoint_dir(callback, trainer)
        directories[directory] = None
        paths.update((e.path, None) for e in candidates(directory, (callback.FILE_EXTENSION,)))
    twins = _mirror_copies(callbacks, directories, paths)
    io = trainer.strategy.checkpoint_io
    weights_only = lc.fit_weights_only(trainer) is not False  # None: the safe default, as torch.load takes it
    deferred = asks_memory_first(trainer) if memory_first is None else memory_first
    skipped: list[str] = []
    path = _newest(io, list(paths), skipped, weights_only, deferred)
    chosen = -1 if path is None else step_in_name(path) or -1
    passed = [p for p in twins if (step_in_name(p) or -1) > chosen]
    if passed:  # a newer local copy did not verify: its mirror copy, before anything older
        older = [p for p in paths if path is not None and (step_in_name(p) or -1) <= chosen]
        path = _newest(io, [twins[p] for p in passed] + older, skipped, weights_only, deferred)
    if deferred:  # the full resolution (confirm_last) says what it passes over, if it is needed
        return LastChoice(path, tuple(directories), len(paths) + len(twins), (), deferred=True)
    pickled = _all_pickled([*paths, *twins.values()]) if path is None and skipped and weights_only else {}
    return LastChoice(path, tuple(directories), len(paths) + len(twins), tuple(skipped), pickled)


def asks_memory_first(trainer: pl.Trainer) -> bool:
    """Whether a callback of ``trainer`` resumes this ``fit`` from a memory tier when it can (``MemoryFirst``)."""
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # assigned by Lightning's callback connector
    return any(isinstance(cb, MemoryFirst) and cb.resumes_from_memory_first(trainer) for cb in callbacks)


def confirm_last(trainer: pl.Trainer) -> Optional[str]:
    """The memory tier did not supply the resume: "last" resolved in full, as without it (warnings, the info line,
    ``NoLoadableCheckpointError``), before anything is loaded; the checkpoint to restore (``None``: start over)."""
    return next(iter(report(choose_last(trainer, memory_first=False))), None)


def _newest(io: object, paths: list[str], skipped: list[str], weights_only: bool, headers: bool) -> Optional[str]:
    """The newest of ``paths`` that passes the IO's check, or (``headers``: a memory tier is asked first) whose
    header reads (``io.verify.header_only``)."""
    if headers:  # a sharded directory named as Lightning can time it (on an object store: its marker)
        check = lambda p: header_only(p, weights_only)
        path = newest_verified(paths, check, key=lambda p: progress(p, weights_only), skipped=skipped.append)
        return None if path is None else named_for_lightning(path)
    if isinstance(io, ResolvingCheckpointIO):
        return io.resolve_newest(paths, skipped=skipped.append, weights_only=weights_only)
    return newest_verified(
        paths,
        lambda p: verify(p, io, weights_only=weights_only),
        key=lambda p: progress(p, weights_only),
        skipped=skipped.append,
    )


def _all_pickled(paths: list[str]) -> dict[str, tuple[str, ...]]:
    """The globals each of ``paths`` needs beyond the weights-only allowlist, if every one needs some (``{}``
    otherwise): then that, not damage, is why none loads."""
    needs = {p: pickled_globals(p) for p in paths}
    return needs if needs and all(needs.values()) else {}


@runtime_checkable
class Mirrored(Protocol):
    """A checkpoint callback that keeps a second copy of its files in ``mirror_directory`` (``None``: none)."""

    @property
    def mirror_directory(self) -> Optional[str]: ...


def _mirror_copies(callbacks: list, directories: dict[str, None], paths: dict[str, None]) -> dict[str, str]:
    """Add the mirrors' checkpoints to ``paths`` and ``directories``: each one whose name no local file has
    (a new node's empty disk, a local copy pruned). Returns the others, as local path -> mirror copy: the
    local copy is read first (it is the same checkpoint, nearer), its mirror copy only if it does not verify."""
    local = {storage.basename(p): p for p in paths}
    twins: dict[str, str] = {}
    for callback in callbacks:
        mirror = callback.mirror_directory if isinstance(callback, Mirrored) else None
        if mirror is None:
            continue
        directories[mirror] = None
        for entry in candidates(mirror, (callback.FILE_EXTENSION,)):
            if entry.name in local:
                twins[local[entry.name]] = entry.path
            else:
                paths[entry.path] = None
    return twins


def report(choice: LastChoice) -> set[str]:
    """Tell what was chosen (rank 0), and return it as Lightning's ``_find_last_checkpoints`` does. Raises
    ``NoLoadableCheckpointError`` when checkpoints exist but none loads: starting over would lose the run."""
    if choice.deferred:
        rank_zero_info(choice.describe())
        return {choice.path} if choice.path is not None else set()
    for line in choice.skipped:
        rank_zero_warn(f"ckpt_path='last': {line}", category=SkippedCheckpointWarning)
    if choice.path is None and choice.skipped:
        raise NoLoadableCheckpointError(", ".join(choice.directories), choice.skipped, choice.pickled)
    rank_zero_info(choice.describe())
    return {choice.path} if choice.path is not None else set()


def resumed_from(trainer: pl.Trainer) -> Optional[str]:
    """The file this run resumed from (``None``: a fresh start): what the trainer's ``ckpt_path`` names, or the
    checkpoint the plugin fell back to when that one failed its hash while loading."""
    path = trainer.ckpt_path
    if not path:
        return None
    io = trainer.strategy.checkpoint_io
    return io.loaded_path(str(path)) if isinstance(io, ResolvingCheckpointIO) else str(path)


class OncePerFit:
    """The resolution for one ``fit``: Lightning asks every checkpoint callback in turn, and the answer (and
    its info line) must come once. ``clear`` at ``setup``, which runs after Lightning's "last" search."""

    def __init__(self) -> None:
        self._trainer: Optional[weakref.ReferenceType[pl.Trainer]] = None
        self._paths: set[str] = set()

    def resolve(self, trainer: pl.Trainer) -> set[str]:
        if self._trainer is None or self._trainer() is not trainer:
            self._paths = report(choose_last(trainer))
            self._trainer = weakref.ref(trainer)
        return set(self._paths)

    def clear(self) -> None:
        self._trainer = None
