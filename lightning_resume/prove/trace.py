"""The trace ``lightning-resume prove`` compares: what one rank of a fit did, record by record, as JSON lines.

This module owns the record format of docs/prove.md and the append-only file it goes to; ``ExactResume``'s
hooks call a ``TraceRecorder`` and do nothing else for it. Recording must not change the run it watches: RNG
states are read, never advanced; nothing is moved to the host but what a digest or a float needs. Nothing
from ``exact`` is imported here (``exact`` imports this module): the callback hands in the hash
(``exact.state.fingerprint.digest``) and its RNG capture, so the dependency runs one way.

The file is written for a process that may be SIGKILLed at any moment: each record is one ``os.write`` of
one line to a descriptor opened with ``O_APPEND`` (no user-space buffer, so a written record is in the
kernel and survives the kill), and a launch that finds the file ending in a torn line first ends that line.
A torn record is therefore always a line of its own, the last one of its launch: a reader skips any line
that does not parse as JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_resume._compat import lightning as lc
from lightning_resume.errors import ConfigurationError
from lightning_resume.prove import files
from lightning_resume.prove.findings import Finding
from lightning_resume.storage import files as storage

TRACE_ENV = "LIGHTNING_RESUME_TRACE"
"""The directory the trace goes to (``<dir>/trace-rank<R>.jsonl``); unset or empty: no recorder."""
DIGEST_EVERY_ENV = "LIGHTNING_RESUME_TRACE_DIGEST_EVERY"
"""Optimizer steps between two ``state`` records (hashing the whole state at every step would slow the run)."""
DEFAULT_DIGEST_EVERY = 10

Digest = Callable[[Any], str]
Components = Callable[[], Mapping[str, str]]
"""Digests of state ExactResume captures beyond Lightning's checkpoint, by name (``"model.lr_scheduler"``)."""


def float_bits(value: Any) -> Optional[str]:
    """The float32 bits of a scalar as 8 hex digits (``"3f385f0f"``): equal strings are bitwise-equal values.
    ``None`` for anything that is not one number (a vector, a string, ``None``)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        scalar = value.detach().reshape(()).to("cpu", torch.float32)  # reading it is the one sync a loss costs
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        scalar = torch.tensor(float(value), dtype=torch.float32)
    else:
        return None
    return f"{int(scalar.view(torch.int32).item()) & 0xFFFFFFFF:08x}"


def loss_of(outputs: Any) -> Any:
    """The loss a training step returned: ``outputs["loss"]`` (automatic optimization gives a dict), the
    tensor itself, or ``None``."""
    if isinstance(outputs, Mapping):
        return outputs.get("loss")
    return outputs if isinstance(outputs, torch.Tensor) else None


def state_due(step: int, every: int, optimizer_stepped: bool) -> bool:
    """Whether a ``state`` record is written at this batch end: after an optimizer step to a multiple of ``every``."""
    return optimizer_stepped and step % every == 0


def digest_every_from(raw: Optional[str]) -> int:
    """``DIGEST_EVERY_ENV``'s value as a positive int (``DEFAULT_DIGEST_EVERY`` when unset or empty)."""
    if raw is None or not raw.strip():
        return DEFAULT_DIGEST_EVERY
    try:
        every = int(raw)
    except ValueError:
        every = 0
    if every < 1:
        raise ConfigurationError(
            "ExactResume trace",
            [f"{DIGEST_EVERY_ENV}={raw!r} must be a whole number >= 1; unset it for {DEFAULT_DIGEST_EVERY}"],
        )
    return every


class TraceFile:
    """One rank's trace file, appended to one whole line per write (see the module docstring). Opened in a
    checked directory, never through a link, and only when it is a regular file of this user (``prove.files``;
    ``files.UnsafeRunFile`` naming the path and why otherwise)."""

    def __init__(self, path: str) -> None:
        self.path = path
        directory = files.trace_directory(os.path.dirname(path) or ".")
        try:
            self._fd: Optional[int] = files.open_append(directory, os.path.basename(path), path)
        finally:
            os.close(directory)
        if _ends_in_torn_line(self._fd):
            self._write(b"\n")  # the killed launch's torn record stays a line of its own

    def write(self, record: Mapping[str, Any]) -> None:
        self._write((json.dumps(record, separators=(",", ":")) + "\n").encode())

    def _write(self, data: bytes) -> None:
        if self._fd is None:
            raise ValueError(f"trace file {self.path} is closed")
        view = memoryview(data)
        while view:  # one call for a line unless the kernel writes it short (a signal, a full disk)
            view = view[os.write(self._fd, view) :]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _ends_in_torn_line(fd: int) -> bool:
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"


@dataclass(frozen=True)
class _BatchStart:
    """What a ``batch`` record takes from the batch start: the step before it, and the inputs as it got them."""

    step: int
    epoch: int
    batch: str
    rng: str
    sched: list[str]
    user: dict[str, str]
    lr: list[float]


class TraceRecorder:
    """Writes the records of docs/prove.md for one rank, each when ``ExactResume``'s hook for it runs.

    Args:
        out: the rank's trace file.
        rank: the trainer's global rank.
        digest_every: a ``state`` record every this many optimizer steps.
        digest: the hash of a nested structure of tensors (``exact.state.fingerprint.digest``).
        capture_rng: returns every RNG stream ExactResume saves, without advancing any.
        clock: wall clock of the ``start`` record's ``time``.
        components: digests of the state ExactResume captures beyond Lightning's checkpoint, by name, as each
            step starts (user-state capture hands its digests here); ``None``: no ``user`` field.
    """

    def __init__(
        self,
        out: TraceFile,
        rank: int,
        digest_every: int,
        digest: Digest,
        capture_rng: Callable[[], Any],
        clock: Callable[[], float] = time.time,
        components: Optional[Components] = None,
    ) -> None:
        self.out = out
        self.rank = rank
        self.digest_every = digest_every
        self._digest = digest
        self._capture_rng = capture_rng
        self._clock = clock
        self._components = components
        self._timed = False  # inside ``timed_saves``: a save now is at a step the clock chose
        self._batch: Optional[_BatchStart] = None
        self._held: Optional[list[dict[str, Any]]] = []  # records before the start record (None once started)

    def start(
        self,
        trainer: pl.Trainer,
        exact: Optional[bool],
        problems: Sequence[str],
        findings: Iterable[Finding] = (),
    ) -> None:
        """After any restore: the step is the one this launch resumed at. What the restore itself ran (the
        validation that was due right after the saved step) was held back and follows this record: it
        belongs to this launch. ``exact``: the resume report's (``None``: nothing restored). ``findings``: the
        same problems with their kinds (``prove.findings``), which the diagnosis reads; ``loaders`` and
        ``schedulers`` say what the run trains with."""
        ckpt = trainer.ckpt_path
        held, self._held = self._held or [], None
        self._write(
            "start", pid=os.getpid(), rank=self.rank, world_size=trainer.world_size, step=trainer.global_step,
            resumed_from=None if ckpt is None else str(ckpt), exact=exact,
            problems=list(problems), findings=[f.to_record() for f in findings], loaders=loader_facts(trainer),
            schedulers=scheduler_facts(trainer), time=self._clock(),
        )  # fmt: skip
        for record in held:
            self.out.write(record)

    def batch_start(self, trainer: pl.Trainer, batch: Any) -> None:
        """Before the step draws anything: its batch, RNG streams, schedulers, captured state and learning rates
        as the step gets them."""
        rates = [float(group["lr"]) for opt in trainer.optimizers for group in opt.param_groups]
        rng = self._digest(self._capture_rng())
        sched = [self._digest(config.scheduler.state_dict()) for config in trainer.lr_scheduler_configs]
        user = dict(self._components()) if self._components is not None else {}
        step, epoch = trainer.global_step, trainer.current_epoch
        self._batch = _BatchStart(step, epoch, self._digest(batch), rng, sched, user, rates)

    def batch_end(self, trainer: pl.Trainer, outputs: Any, batch_idx: int) -> None:
        start, self._batch = self._batch, None
        if start is None:
            return  # a batch end without its start (never in a stock loop): nothing to pair the loss with
        user = {"user": start.user} if self._components is not None else {}
        self._write(
            "batch", step=start.step, micro=batch_idx, epoch=start.epoch, batch=start.batch, rng=start.rng,
            sched=start.sched, **user, loss=float_bits(loss_of(outputs)), lr=start.lr, logged=_logged(trainer),
        )  # fmt: skip
        if state_due(trainer.global_step, self.digest_every, lc.at_optimizer_step(trainer)):
            self._write("state", step=trainer.global_step, **self._weights(trainer))

    def saved(self, trainer: pl.Trainer) -> None:
        """A checkpoint is being written (ExactResume's ``state_dict``): the state it holds; ``timed`` when its
        step was chosen by the clock (a scheduled, preemption or memory-tier snapshot: ``timed_saves``)."""
        timed = {"timed": True} if self._timed else {}
        self._write("saved", step=trainer.global_step, **self._weights(trainer), **timed)

    def validation_start(self, trainer: pl.Trainer) -> None:
        """A marker, not compared: ``prove`` kills a launch here to test a kill during validation."""
        if not trainer.sanity_checking:
            self._write("val_start", step=trainer.global_step)

    def validation_end(self, trainer: pl.Trainer) -> None:
        if trainer.sanity_checking:
            return  # not a validation of the training run: a resumed launch may run it or not
        self._write("val", step=trainer.global_step, metrics=_logged(trainer))

    def end(self, trainer: pl.Trainer, timed_files: Iterable[str] = (), retention_files: Iterable[str] = ()) -> None:
        """The final state and the checkpoint files. Of those, ``timed_files`` are snapshots (their steps were
        chosen by the clock) and ``retention_files`` are kept by a retention that counts snapshots
        (``exact.snapshots``): both are there or not depending on when snapshots were taken."""
        schedulers = [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]
        files = checkpoint_files(trainer)
        self._write(
            "end", step=trainer.global_step, **self._weights(trainer), sched=self._digest(schedulers),
            metrics=_logged(trainer),  # the last epoch's, logged after its last validation
            files=files, timed_files=sorted(set(timed_files) & set(files)),
            retention_files=sorted(set(retention_files) & set(files)),
        )  # fmt: skip

    def close(self) -> None:
        self.out.close()

    def _weights(self, trainer: pl.Trainer) -> dict[str, str]:
        optimizers = [opt.state_dict() for opt in trainer.optimizers]
        return {"params": self._digest(trainer.lightning_module.state_dict()), "optim": self._digest(optimizers)}

    def _write(self, kind: str, **fields: Any) -> None:
        if self._held is not None and kind != "start":
            self._held.append({"kind": kind, **fields})
            return
        self.out.write({"kind": kind, **fields})


def _logged(trainer: pl.Trainer) -> dict[str, str]:
    """The float bits of every scalar the run has logged so far (``trainer.callback_metrics``)."""
    metrics = {name: float_bits(value) for name, value in trainer.callback_metrics.items()}
    return {name: bits for name, bits in metrics.items() if bits is not None}


@contextlib.contextmanager
def timed_saves(recorder: Optional[TraceRecorder]) -> Iterator[None]:
    """Within it, every ``saved`` record is marked ``timed``: its step was chosen by the clock (the snapshot
    schedule, a preemption), so another run takes it at another step. ``None`` (no recorder): nothing."""
    if recorder is None:
        yield
        return
    recorder._timed = True
    try:
        yield
    finally:
        recorder._timed = False


def loader_facts(trainer: pl.Trainer) -> dict[str, Any]:
    """What the run trains on, for the diagnosis: how Lightning combines the train loaders (``mode``, ``None``
    for a single loader) and each loader's type and dataset type, and whether that dataset is iterable."""
    loaders = lc.train_loaders(trainer)
    each = []
    for loader in loaders:
        dataset = getattr(loader, "dataset", None)
        each.append({
            "type": type(loader).__name__, "dataset": None if dataset is None else type(dataset).__name__,
            "iterable": isinstance(dataset, torch.utils.data.IterableDataset),
        })  # fmt: skip
    return {"mode": lc.combined_mode(trainer) if len(loaders) > 1 else None, "each": each}


def scheduler_facts(trainer: pl.Trainer) -> list[dict[str, Any]]:
    """Each LR scheduler Lightning saves (returned by ``configure_optimizers``): its type, whether it is a
    plateau scheduler (stepped on a metric), and its interval."""
    return [
        {"type": type(config.scheduler).__name__, "plateau": bool(config.reduce_on_plateau),
         "interval": config.interval}
        for config in trainer.lr_scheduler_configs
    ]  # fmt: skip


def checkpoint_files(trainer: pl.Trainer) -> list[str]:
    """Sorted names in every ``ModelCheckpoint``'s directory (a URL too), hidden files (temporaries) left out.
    A checkpoint callback that is no ``ModelCheckpoint`` has no directory to list."""
    names: set[str] = set()
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            entries = storage.list_dir(lc.checkpoint_dir(callback, trainer))
            names.update(entry.name for entry in entries if not entry.name.startswith("."))
    return sorted(names)


def from_environment(
    rank: int,
    digest: Digest,
    capture_rng: Callable[[], Any],
    environ: Optional[Mapping[str, str]] = None,
    clock: Callable[[], float] = time.time,
    components: Optional[Components] = None,
) -> Optional[TraceRecorder]:
    """The recorder ``TRACE_ENV`` asks for (``os.environ`` unless ``environ`` is given), or ``None``.

    Read once per fit: ``lightning-resume prove`` sets the variables from outside the user's script, which is
    why this one input is an environment variable. ``None`` means the run pays nothing: no file, no hashing.
    The directory is a local one (an object store cannot append); it is created (0700) if missing, and
    refused (``prove.files.UnsafeRunFile``) when it is a link, another user's or writable by others. ``components``:
    see ``TraceRecorder`` (user-state capture wires its digests in here, e.g.
    ``components=lambda: user_state_digests(...)`` in ``ExactResume._trace_from_environment``).
    """
    env = os.environ if environ is None else environ
    directory = env.get(TRACE_ENV)
    if not directory:
        return None
    every = digest_every_from(env.get(DIGEST_EVERY_ENV))
    out = TraceFile(os.path.join(directory, f"trace-rank{rank}.jsonl"))
    return TraceRecorder(out, rank, every, digest, capture_rng, clock, components)
