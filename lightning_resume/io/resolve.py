"""Which entries of a directory are checkpoints, in what order, and which one to resume from.

:func:`candidates` is the one rule for "the checkpoints in this directory", used by
``RetentionCheckpoint`` (its files, "last"), the plugin (the siblings of a ``last`` file that failed),
sharded runs (their committed directories) and the CLI (``verify DIR``, ``prune``). :func:`progress`
is the one order: training progress (the step), never wall time alone, so a node whose clock stepped
back cannot make an old checkpoint look new. :func:`newest_verified` walks candidates newest first
and returns the first that passes a check, reporting each one skipped with the reason.

Lightning resolves ``ckpt_path="last"`` to the newest ``last*.ckpt`` by modification time and loads it
blindly; the callers above resolve through here instead. Knows files (through ``storage``), not
Lightning's loops.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

from lightning_resume.errors import SkippedCheckpointWarning
from lightning_resume.format.codec import parse_tree
from lightning_resume.format.legacy import is_zip, load_legacy
from lightning_resume.format.read import is_safetensors, read_summary
from lightning_resume.io.verify import problem
from lightning_resume.io.verify import verify as verify_checkpoint
from lightning_resume.sharded.marker import commit_order, is_sharded_checkpoint, marked_directory, meta_path
from lightning_resume.sharded.verify import verify_directory
from lightning_resume.storage import files as storage

CHECKPOINT_SUFFIXES = (".ckpt", ".safetensors")
_LAST_STEM = re.compile(r"^last(-v\d+)?$")
_STEP_IN_NAME = re.compile(r"step=([0-9]+)")

Verify = Callable[[str], object]
"""Returns (any value, ignored) if a path verifies, raises naming the problem otherwise (any exception skips the path)."""
Skipped = Callable[[str], None]
"""Told one line per candidate passed over."""
Progress = Tuple[int, float]
"""(step, modification time): how far training was when a checkpoint was written."""


def candidates(directory: str, suffixes: Sequence[str] = CHECKPOINT_SUFFIXES) -> List[storage.Entry]:
    """The checkpoints directly in ``directory``, by name: every entry that is not hidden (temporaries,
    staging and replaced directories and our own bookkeeping files start with a dot) and is a file whose
    name ends in one of ``suffixes``, or a sharded checkpoint directory (whatever its name). ``[]`` if
    ``directory`` does not exist."""
    ends = tuple(suffixes)
    out = []
    for entry in storage.list_dir(directory):
        if entry.name.startswith("."):
            continue
        if entry.is_dir and is_sharded_checkpoint(entry.path) or not entry.is_dir and entry.name.endswith(ends):
            out.append(entry)
    return out


def progress(path: str, weights_only: bool = True) -> Optional[Progress]:
    """How far training was at ``path``: its step and modification time; ``None`` if it is gone.

    The step comes from the name (``step=N``, as Lightning's and our rolling names carry it), else from a
    sharded directory's commit marker, else from the ``global_step`` a file holds (``last.ckpt``: the header
    of our format, or a local ``torch.save`` zip's pickle with its tensors mapped, loaded as ``weights_only``
    says); ``-1`` when none says (such a file ranks below every one that does, then by time). An
    uncommitted sharded directory is not a checkpoint yet: ``None``.
    """
    path = str(path)
    if storage.is_dir(path):
        return commit_order(path)
    mtime = storage.mtime(path)
    if mtime is None:
        return None
    step = step_in_name(path)
    return (step if step is not None else _header_step(path, weights_only), mtime)


def step_in_name(path: str) -> Optional[int]:
    """The ``N`` of ``step=N`` (ASCII digits) in the name of ``path``, as Lightning's and our rolling names carry it."""
    match = _STEP_IN_NAME.search(storage.basename(str(path)))
    return int(match.group(1)) if match else None


def _header_step(path: str, weights_only: bool = True) -> int:
    """The ``global_step`` a file holds, read without its tensors (:func:`header_value`); ``-1`` when it
    cannot be told."""
    try:
        step = header_value(path, ("global_step",), weights_only)
    except Exception:  # noqa: BLE001 - any file may sit in a checkpoint directory; its step is just unknown
        return -1
    return step if type(step) is int else -1


def header_value(path: str, keys: Sequence[str], weights_only: bool = True) -> Any:
    """A plain value (number, string) at ``keys`` in the checkpoint dict at ``path``, read without its tensors:
    from a safetensors header's tree, or (local) the pickle of a ``torch.save`` zip with its tensors
    memory-mapped, not read (loaded as ``weights_only`` says: ``format.legacy``); for a sharded checkpoint
    directory (or, on an object store, its commit marker), from the header of its ``meta.safetensors``, found
    through the marker: nothing else of the directory is read. ``None`` when it is absent or the file is
    neither; errors of a damaged file (an uncommitted directory among them) propagate."""
    directory = marked_directory(path)
    if directory is not None:
        path = meta_path(directory)
    if is_safetensors(path):
        node = parse_tree(read_summary(path).tree_json)
        for key in keys:  # each dict level of the tree is {"@": "dict", "v": {...}} (format.codec)
            inner = node.get("v") if isinstance(node, dict) and node.get("@") == "dict" else None
            if not isinstance(inner, dict) or key not in inner:
                return None
            node = inner[key]
        return node if isinstance(node, (int, float, str)) and not isinstance(node, bool) else None
    if storage.is_local(path) and is_zip(path, storage.local_path(path)):
        value: Any = load_legacy(path, storage.local_path(path), mmap=True, weights_only=weights_only)
        for key in keys:
            if not isinstance(value, dict) or key not in value:
                return None
            value = value[key]
        return value
    return None


def newest_first(paths: Iterable[str], key: Callable[[str], Any] = progress) -> List[str]:
    """``paths`` ordered newest first by ``key`` (ties: the greater path); those whose key is ``None`` dropped."""
    keyed = [(k, str(p)) for p in paths if (k := key(str(p))) is not None]
    return [p for _, p in sorted(keyed, reverse=True)]


def warn_skipped(line: str) -> None:
    warnings.warn(line, SkippedCheckpointWarning, stacklevel=3)


def newest_verified(
    paths: Iterable[str],
    verify: Optional[Verify] = None,
    key: Optional[Callable[[str], Any]] = progress,
    skipped: Skipped = warn_skipped,
) -> Optional[str]:
    """The newest of ``paths`` (greatest ``key``; ``key=None``: already ordered newest first) that verifies;
    ``None`` if none. ``verify`` defaults to ``io.verify.verify``; each path that fails it is reported
    through ``skipped``, naming it and why."""
    check = verify if verify is not None else verify_checkpoint
    for path in newest_first(paths, key) if key is not None else [str(p) for p in paths]:
        why = problem(path, check=check)
        if why is None:
            return path
        skipped(f"skipping checkpoint {path}: {why}")
    return None


def is_last_name(path: str) -> bool:
    """Whether ``path`` is named like ModelCheckpoint's "last" file (``last.ckpt``, ``last-v1.ckpt``)."""
    stem = storage.basename(str(path)).rsplit(".", 1)[0]
    return bool(_LAST_STEM.match(stem))


def siblings(path: str) -> List[str]:
    """The other checkpoints in the directory of ``path`` (:func:`candidates`, ``path`` left out)."""
    parent = storage.split(str(path))[0]
    return [e.path for e in candidates(parent) if storage.basename(e.path) != storage.basename(str(path))]


def newest_committed(root: str, digests: bool = True) -> Optional[str]:
    """The newest committed checkpoint directory directly under ``root`` that verifies (``None`` if none).

    Newest = highest step, then latest commit; each one that does not verify is skipped with a
    ``SkippedCheckpointWarning`` naming it.
    """
    directories = [e.path for e in candidates(root) if e.is_dir]
    return newest_verified(directories, lambda path: verify_directory(path, digests))
