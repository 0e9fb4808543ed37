"""Checkpoint files on disk as retention sees them: listing a directory, and the records a file carries.

Lists the candidate checkpoints of a ``dirpath`` (files, and sharded checkpoint directories), reads
the ``ModelCheckpoint``-family state a checkpoint holds without running code, and turns a directory
into ``CheckpointRecord``s for ``lightning-resume prune``. It knows files, not Lightning's loops, and
decides nothing about what to keep (``policy``) or whether a file is good (``io.verify``).
"""

from __future__ import annotations

import math
import os
import re
from typing import NamedTuple, Optional

from lightning_resume.io import remote
from lightning_resume.io.read import load_file
from lightning_resume.io.verify import problem
from lightning_resume.retention.naming import parse_rolling_name
from lightning_resume.retention.policy import ANCHOR, CheckpointRecord


class FileEntry(NamedTuple):
    path: str
    mtime: float


def list_checkpoint_files(dirpath: str, extension: str = ".ckpt") -> list:
    """Checkpoints in ``dirpath`` ending in ``extension``: files, and directories (sharded checkpoints
    written through torch.distributed.checkpoint), oldest modification first."""
    if "://" not in str(dirpath):  # a URL (s3://, file://...) is listed through fsspec, scheme kept
        if not os.path.isdir(dirpath):
            return []
        entries = []
        for name in os.listdir(dirpath):
            path = os.path.join(dirpath, name)
            if name.endswith(extension) and (os.path.isfile(path) or os.path.isdir(path)):
                try:
                    entries.append(FileEntry(os.path.normpath(path), os.path.getmtime(path)))
                except FileNotFoundError:
                    continue  # deleted since the listing (a concurrent prune): not a candidate any more
        return sorted(entries, key=lambda e: (e.mtime, e.path))
    found = [e for e in remote.list_dir(dirpath) if e.name.endswith(extension) and not e.name.startswith(".")]
    return sorted((FileEntry(e.path, e.mtime) for e in found), key=lambda e: (e.mtime, e.path))


def read_checkpoint_callback_state(path: str, state_key: Optional[str] = None) -> Optional[dict]:
    """The ``ModelCheckpoint``-family state saved in ``path`` (under ``state_key`` if given, else the
    first one), or ``None`` if it cannot be read safely. Reads any of the formats without running code
    and without reading tensors it does not need (memory-mapped, unverified: the state is advisory).
    """
    try:
        if remote.is_dir(path):
            from lightning_resume.sharded.api import load_meta  # DCP is imported only for sharded runs

            checkpoint = load_meta(path)
        else:
            checkpoint = load_file(path, verify=False, lenient=True, mmap=True).checkpoint
    except Exception:  # noqa: BLE001 - any unreadable or unsafe file simply has no usable state
        return None
    callbacks = checkpoint.get("callbacks", {}) if isinstance(checkpoint, dict) else {}
    if not isinstance(callbacks, dict):
        return None
    for key, state in callbacks.items():
        wanted = key == state_key if state_key else str(key).startswith("ModelCheckpoint{")
        if wanted and isinstance(state, dict):
            return state
    return None


def owned_record(retention_state: object, path: str, run_id: Optional[str] = None) -> Optional[dict]:
    """The record a ``RetentionCheckpoint`` saved inside ``path`` for ``path`` itself (of run ``run_id``
    if given), or ``None``: ownership is proven by the file's own record, never by its name."""
    if not isinstance(retention_state, dict):
        return None
    if run_id is not None and retention_state.get("run_id") != run_id:
        return None
    name = os.path.basename(path)
    for saved in _saved_records(retention_state):
        if os.path.basename(str(saved.get("path"))) == name:
            return saved
    return None


def _saved_records(retention_state: object) -> list[dict]:
    """The saved records of a ``RetentionCheckpoint`` state that are dicts; anything else in a file is ignored."""
    saved = retention_state.get("records") if isinstance(retention_state, dict) else None
    return [s for s in saved if isinstance(s, dict)] if isinstance(saved, (list, tuple)) else []


def _saved_anchor_names(state: Optional[dict]) -> set[str]:
    """Base names the saved records tag as anchors; odd records (no path, tags not a list) are ignored."""
    names = set()
    for saved in _saved_records((state or {}).get("retention")):
        tags = saved.get("tags")
        if isinstance(saved.get("path"), str) and isinstance(tags, (list, tuple)) and ANCHOR in tags:
            names.add(os.path.basename(saved["path"]))
    return names


_ANY_STEP = re.compile(r"step=([0-9]+)")


def records_in(dirpath: str, monitor: Optional[str] = None) -> list[CheckpointRecord]:
    """One record per ``.ckpt`` checkpoint in ``dirpath``; anchor tags carried over from the saved states.

    The step comes from the rolling name; a file is owned only if it carries a ``RetentionCheckpoint``
    record of itself (any other file, whatever its name, is recorded as not owned); the metric
    from the file's own ``ModelCheckpoint`` state, ``verified`` from ``io.verify``.
    """
    records, anchors = [], set()
    for entry in list_checkpoint_files(dirpath):
        state = read_checkpoint_callback_state(entry.path)
        records.append(_record(entry, state, monitor))
        anchors |= _saved_anchor_names(state)
    return [r if os.path.basename(r.path) not in anchors else _tag_anchor(r) for r in records]


def _tag_anchor(record: CheckpointRecord) -> CheckpointRecord:
    return CheckpointRecord(**{**record.__dict__, "tags": record.tags | {ANCHOR}})


def _record(entry: FileEntry, state: Optional[dict], monitor: Optional[str]) -> CheckpointRecord:
    step = parse_rolling_name(entry.path)
    owned = step is not None and owned_record((state or {}).get("retention"), entry.path) is not None
    if step is None:
        match = _ANY_STEP.search(os.path.basename(entry.path))
        step = int(match.group(1)) if match else 0
    metric = _metric(state, monitor)
    verified = problem(entry.path) is None
    return CheckpointRecord(entry.path, step, 0, entry.mtime, metric, frozenset(), verified, False, owned)


def _metric(state: Optional[dict], monitor: Optional[str]) -> Optional[float]:
    if not state or state.get("current_score") is None:
        return None
    if monitor is not None and state.get("monitor") != monitor:
        return None
    try:
        value = float(state["current_score"])
    except (TypeError, ValueError, OverflowError, RuntimeError):
        return None  # not a number (a file may hold anything): no metric, so never ranked as best
    return None if math.isnan(value) else value
