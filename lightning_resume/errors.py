"""Every exception and warning lightning-resume raises or emits, in one place.

Errors derive from ``LightningResumeError``, warnings from ``LightningResumeWarning``, so a user can
catch or filter the whole product at once. Each error names the thing that is wrong and the fix.
This module owns only the types (and ``short_repr`` and ``byte_size``, for their messages); it must not
import Lightning, torch or touch files.
"""

from __future__ import annotations

import errno
from typing import Any, Iterable, Mapping, Optional

# ------------------------------------------------------------------------------------------ errors


class LightningResumeError(Exception):
    """Base class of every error raised by lightning-resume."""


class ConfigurationError(LightningResumeError, ValueError):
    """Invalid constructor arguments. Collects every problem before raising."""

    def __init__(self, owner: str, problems: Iterable[str]) -> None:
        self.owner = owner
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{owner}: invalid configuration:\n{lines}")


class ResumeMismatchError(LightningResumeError):
    """The checkpoint does not fit the current run, so an exact resume is impossible.

    ``differences`` lists what differs, one human-readable line each.
    """

    def __init__(self, source: str, differences: Iterable[str], hint: str) -> None:
        self.source = source
        self.differences = list(differences)
        self.hint = hint
        lines = "\n".join(f"  - {d}" for d in self.differences)
        super().__init__(f"cannot resume exactly from {source}:\n{lines}\n{hint}")


class CheckpointCorruptError(LightningResumeError):
    """A checkpoint failed verification (truncated, flipped bytes, lying header, missing shard...)."""

    overwritten_in_place: int = 0
    """How many tensors of the live module the load had read in place before it failed (``load_in_place``)."""

    def __init__(self, path: str, what: str, expected: object = None, actual: object = None) -> None:
        self.path = str(path)
        self.what = what
        self.expected = expected
        self.actual = actual
        has_detail = expected is not None or actual is not None
        detail = f" (expected {expected!r}, found {actual!r})" if has_detail else ""
        super().__init__(f"{self.path}: {what}{detail}")


class UnsafeCheckpointError(LightningResumeError):
    """A checkpoint would need code execution (pickle globals) to load; it was refused."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: refused to load: {reason}")


UNPICKLING_FIXES = (
    "Two fixes work. If you trust where the checkpoint comes from, load it with weights_only=False:"
    " trainer.fit(..., ckpt_path=..., weights_only=False) (lightning-resume verify/convert: --no-weights-only),"
    " which runs the code it names."
    " To write checkpoints that need no code, keep such objects out of them: for an nn.Module or a functools.partial"
    " passed to __init__, self.save_hyperparameters(ignore=[...]) naming those arguments (pass them again to"
    " load_from_checkpoint)."
)
"""What to do about a checkpoint that needs pickled objects: one text for every message that says so."""


class PickledCheckpointError(UnsafeCheckpointError):
    """An intact ``torch.save`` checkpoint holds objects only unpickling code can rebuild (an ``nn.Module`` or
    a ``functools.partial`` in the hyper-parameters): a weights-only load, the default, refuses it. ``globals``
    names what the file would import and call (``torch.nn.modules.linear.Linear``)."""

    def __init__(self, path: str, globals: Iterable[str]) -> None:
        self.globals = tuple(sorted(set(globals)))
        names = ", ".join(self.globals) or "globals outside the safe allowlist"
        super().__init__(
            path,
            f"it holds pickled objects that a weights-only load (the default: no code runs when a checkpoint is"
            f" read) refuses: {names}. {UNPICKLING_FIXES}",
        )


class RemoteLoadMemoryError(LightningResumeError):
    """Loading a checkpoint from a URL would hold more host memory than ``limit`` allows (the memory the
    host or its cgroup has left, or ``RemoteOptions.max_load_bytes``); refused before its data was downloaded."""

    def __init__(self, url: str, size: int, needed: int, limit: int, what: str, cap_option: bool) -> None:
        self.url = str(url)
        self.size = size
        self.needed = needed
        self.limit = limit
        self.what = what
        raise_it = (
            "or raise the cap (SafetensorsCheckpointIO(remote=RemoteOptions(max_load_bytes=...)), in bytes)"
            if cap_option
            else "or run where more memory is free (a cap, remote.max_load_bytes, only lowers this bound)"
        )
        super().__init__(
            f"{self.url}: refused to load this {byte_size(size)} checkpoint from remote storage: the load holds about"
            f" {byte_size(needed)} of host memory, more than {what} ({byte_size(limit)}). None of its data was"
            " downloaded and the file is unchanged. Free memory, copy the file to local disk and load it from there (a local"
            f" load reads it tensor by tensor, holding it once), {raise_it}."
        )


class RemoteReadTimeoutError(LightningResumeError, TimeoutError):
    """A read from a URL did not end within its deadline (``RemoteOptions.read_deadline``), every retry of every
    layer included (ours, s3fs's, botocore's): the server accepted the request and did not answer in time."""

    def __init__(self, url: str, what: str, deadline_s: float) -> None:
        self.url = str(url)
        self.deadline_s = deadline_s
        super().__init__(
            f"could not {what} {self.url} within its deadline of {deadline_s:g} s (remote.read_deadline, every retry"
            " included): the server accepted the request but did not answer in time. Check the endpoint, or raise"
            ' the deadline: SafetensorsCheckpointIO(remote=RemoteOptions(read_deadline="30min")).'
        )


class RangeMismatchError(LightningResumeError, OSError):
    """A ranged GET was answered with other bytes than the range asked for: more (the server ignores ``Range``
    and sends the whole object), fewer, or from another offset. Refused before more than the range was held.
    ``transient`` (a short body: a transfer cut) is retried; the others are not."""

    def __init__(self, url: str, start: int, end: int, answered: str, transient: bool) -> None:
        self.url, self.start, self.end, self.transient = str(url), start, end, transient
        fix = (
            "the transfer was cut short or the object changed while it was read"
            if transient
            else "the endpoint does not honour HTTP Range requests (every remote load reads by range). Use an"
            " S3-compatible endpoint that does, or copy the file to local disk and load it from there"
        )
        super().__init__(
            f"{self.url}: a ranged GET of bytes {start}-{end - 1} ({end - start} bytes) was answered with {answered};"
            f" refused: {fix}"
        )
        self.errno = errno.EREMOTEIO if transient else errno.EPROTO  # the retry layer reads transience from errno


class UnencodableValueError(LightningResumeError, TypeError):
    """A value in the checkpoint has no safe, pickle-free encoding; nothing was written."""

    def __init__(self, key_path: str, type_name: str, reason: str = "", fix: str = "") -> None:
        self.key_path = key_path
        self.type_name = type_name
        self.reason = reason
        why = f" ({reason})" if reason else ""
        super().__init__(
            f"cannot store checkpoint value at '{key_path}' of type {type_name}{why}: SafetensorsCheckpointIO "
            f"writes no pickle. {fix or _fix_for(key_path)}"
        )


HPARAMS_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")
"""Where Lightning puts ``save_hyperparameters()``'s values in a checkpoint (of the module, of the datamodule)."""


def hparam_name(key_path: str) -> str:
    """The hyper-parameter a checkpoint key path lies in (``hyper_parameters.net.0`` -> ``net``); ``""`` if none."""
    top, _, rest = key_path.partition(".")
    return rest.split(".", 1)[0] if top in HPARAMS_KEYS else ""


def hparams_fix(names: Iterable[str]) -> str:
    """How to keep the hyper-parameters ``names`` out of every checkpoint."""
    listed = sorted(set(names))
    again = ", ".join(f"{n}=..." for n in listed)
    return (
        "It is a hyper-parameter; an nn.Module or a function (a functools.partial) has no encoding that loads"
        f" without running code. Leave such values out with self.save_hyperparameters(ignore={listed!r}) (and"
        f" pass them again to load_from_checkpoint(..., {again})), make them plain values (numbers, strings,"
        " lists and dicts of them), or, for another type that plain values rebuild, register a converter with"
        " lightning_resume.register_converter(type, encode, decode, name)."
    )


def _fix_for(key_path: str) -> str:
    """The fix for an unencodable value, by where it sits: a hyper-parameter is left out by name."""
    name = hparam_name(key_path)
    if name:
        return hparams_fix([name])
    return (
        "Make it a tensor, number, string, list, tuple or dict (e.g. convert a config "
        "object with dataclasses.asdict / vars()), or register a converter with "
        "lightning_resume.register_converter(type, encode, decode, name)."
    )


class NoLoadableCheckpointError(LightningResumeError):
    """``ckpt_path="last"`` found checkpoints but none verifies; starting over would silently lose the run."""

    def __init__(
        self, directory: str, problems: Iterable[str], pickled: Optional[Mapping[str, Iterable[str]]] = None
    ) -> None:
        self.directory = str(directory)
        self.problems = list(problems)
        self.pickled = {str(path): tuple(names) for path, names in (pickled or {}).items()}
        if self.pickled:  # every one is intact but needs unpickling: say so once, with the fixes that work
            lines = "\n".join(f"  - {path}: {', '.join(names)}" for path, names in self.pickled.items())
            super().__init__(
                f"ckpt_path='last': {len(self.pickled)} checkpoint(s) in {self.directory} and none loads"
                f" weights-only (the default): each holds pickled objects that only running code can rebuild:\n"
                f"{lines}\n{UNPICKLING_FIXES}"
            )
            return
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(
            f"ckpt_path='last': {len(self.problems)} checkpoint(s) in {self.directory} and none loads:\n{lines}\n"
            "Fix or move them, resume from a file by its path, or pass ckpt_path=None to start a new run."
        )


class PartialLoadError(LightningResumeError):
    """A load failed after it had read some of the file's tensors into the live module (``load_in_place``), for
    a reason other than a checksum (an unknown type in the tree, a remote read cut mid-body), chained from that
    reason; also raised at the start of a fit on a module so left (``format.partial``). A checksum failure stays
    a ``CheckpointCorruptError`` and says the same."""

    def __init__(self, path: str, message: str, overwritten: int) -> None:
        self.path = str(path)
        self.overwritten_in_place = overwritten
        super().__init__(message)


class UnknownTypeError(LightningResumeError):
    """The file names a type (enum class, converter) this process does not know."""


class TreeFormatError(LightningResumeError, ValueError):
    """The typed JSON tree is malformed; readers wrap it into ``CheckpointCorruptError`` with the file name."""


class AsyncWriteError(LightningResumeError, OSError):
    """A background checkpoint write failed; raised on the training thread, naming the file."""

    def __init__(self, path: str, cause: BaseException, action: str = "write") -> None:
        self.path = path
        self.cause = cause
        self.action = action
        super().__init__(
            f"background {action} of checkpoint {path} failed: {type(cause).__name__}: {cause}. No partial file"
            " was left and earlier checkpoints are untouched. Fix the cause (free disk space, directory"
            " permissions, the storage backend), or pass SafetensorsCheckpointIO(on_error='warn') to keep"
            " training without this checkpoint."
        )


class WriterProcessDied(LightningResumeError, OSError):
    """The checkpoint writer process (``SafetensorsCheckpointIO(writer="process")``) ended during or before a
    write; the cause of the ``AsyncWriteError`` of that write, naming the process and how it ended."""

    def __init__(self, pid: int, returncode: int | None, path: str) -> None:
        self.pid, self.returncode, self.path = pid, returncode, path
        if returncode is None:
            how = "closed its pipe"
        elif returncode < 0:
            how = f"was killed by signal {-returncode}"
        else:
            how = f"exited with status {returncode}"
        super().__init__(
            f"the checkpoint writer process (pid {pid}) {how} before it reported the commit of {path}; its"
            " temporary was removed, so the file under that name is the previous checkpoint (or the new one,"
            " whole, if the rename had happened). The next save starts a new writer process"
        )


class ReplicaTransferError(LightningResumeError, OSError):
    """A memory-tier file sent to or received from a peer rank did not arrive whole (``memory.transport``):
    the peer ended, the stream lost step, or the sizes it announced are out of bounds. Names the peer."""

    def __init__(self, peer: int, what: str) -> None:
        self.peer, self.what = peer, what
        super().__init__(f"memory-tier transfer with rank {peer}: {what}")


class StagingAborted(LightningResumeError):
    """The snapshot copy failed on the training thread; the write waiting for its bytes stops (no file)."""


class RanksOutOfStepError(LightningResumeError, RuntimeError):
    """Not every rank reached an agreement point of ``ExactResume`` in time: a rank crashed, hangs, or
    waits in another collective. Raised on every rank that got there, naming the ranks that did not."""

    def __init__(self, what: str, timeout_s: float, detail: str) -> None:
        self.what = what
        self.timeout_s = timeout_s
        super().__init__(
            f"not every rank reached {what} within {timeout_s:g}s ({detail}); look at the logs of the ranks named"
            " there: a rank that crashed, or that resolved another checkpoint, stops the others here"
        )


class ShardedSaveError(LightningResumeError):
    """A sharded save failed on some rank; every rank raises this same error (none is left waiting)."""

    def __init__(self, directory: str, step: str, problems: Mapping[int, str]) -> None:
        self.directory = directory
        self.problems = dict(problems)
        ranks_by_problem: dict[str, list[int]] = {}
        for rank, problem in sorted(self.problems.items()):
            ranks_by_problem.setdefault(problem, []).append(rank)
        where = "; ".join(
            f"{'ranks' if len(r) > 1 else 'rank'} {', '.join(map(str, r))}: {problem}"
            for problem, r in ranks_by_problem.items()
        )
        super().__init__(
            f"sharded save of {directory} failed to {step} ({where}); the previous checkpoint there, if any, is untouched"
        )


# ---------------------------------------------------------------------------------------- warnings


class LightningResumeWarning(UserWarning):
    """Base class of every warning emitted by lightning-resume."""


class SkippedCheckpointWarning(LightningResumeWarning):
    """A candidate checkpoint failed verification and was passed over."""


class AsyncWriteWarning(LightningResumeWarning):
    """A background checkpoint write failed or did not finish, and ``on_error='warn'`` (or shutdown) let
    training go on."""


class HistoryWarning(LightningResumeWarning):
    """The failure history could not be read or written; training goes on without it."""


class PreemptionWarning(LightningResumeWarning):
    """Preemption handlers could not be installed or restored, or a cloud's preemption-notice endpoint answered
    badly (malformed, late, unreachable, too slow); says why. Training goes on."""


class ExactResumeWarning(LightningResumeWarning):
    """The resumed run will not be exact (and why), or a snapshot could not be taken as configured."""


class RetentionWarning(LightningResumeWarning):
    """A retention decision worth a person's attention: a file that does not verify, a deletion (verbose)."""


class ShardedCheckpointWarning(LightningResumeWarning):
    """A sharded checkpoint was left uncommitted, or a replaced one could not be deleted yet."""


class VersionWarning(LightningResumeWarning):
    """A dependency version this release was not verified with; the private APIs it relies on may differ."""


class LeftoverProcessWarning(LightningResumeWarning):
    """``prove``: a process its launch started was still running after the launch ended; it was killed."""


def byte_size(n: int) -> str:
    """``n`` bytes for a message: ``"64.0 MiB (67108864 bytes)"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"


def short_repr(x: Any) -> str:
    """``repr(x)`` cut to fit an error message."""
    text = repr(x)
    return text if len(text) < 80 else text[:77] + "..."
