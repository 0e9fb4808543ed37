"""Checkpoint files on disk as retention sees them: listing a directory, and the records a file carries.

Reads the ``ModelCheckpoint``-family state a checkpoint holds without running code, and turns the
checkpoints of a directory (``io.resolve.candidates``) into ``CheckpointRecord``s for
``lightning-resume prune``. It knows files, not Lightning's loops, and
decides nothing about what to keep (``policy``) or whether a file is good (``io.verify``).
"""

from __future__ import annotations

import math
from typing import Optional

from lightning_resume.format.read import load_file
from lightning_resume.io.resolve import candidates, step_in_name
from lightning_resume.io.verify import problem
from lightning_resume.retention.naming import parse_rolling_name
from lightning_resume.retention.policy import ANCHOR, CheckpointRecord
from lightning_resume.storage import files as storage


def read_checkpoint_callback_state(path: str, state_key: Optional[str] = None) -> Optional[dict]:
    """The ``ModelCheckpoint``-family state saved in ``path`` (under ``state_key`` if given, else the
    first one), or ``None`` if it cannot be read safely. Reads any of the formats without running code
    and without reading tensors it does not need (memory-mapped, unverified: the state is advisory).
    """
    try:
        if storage.is_dir(path):
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
    name = storage.basename(path)
    for saved in _saved_records(retention_state):
        if storage.basename(str(saved.get("path"))) == name:
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
            names.add(storage.basename(saved["path"]))
    return names


def records_in(dirpath: str, monitor: Optional[str] = None) -> list[CheckpointRecord]:
    """One record per ``.ckpt`` checkpoint in ``dirpath``; anchor tags carried over from the saved states.

    The step comes from the rolling name; a file is owned only if it carries a ``RetentionCheckpoint``
    record of itself (any other file, whatever its name, is recorded as not owned); the metric
    from the file's own ``ModelCheckpoint`` state, ``verified`` from ``io.verify``.
    """
    records, anchors = [], set()
    for entry in candidates(dirpath, (".ckpt",)):
        state = read_checkpoint_callback_state(entry.path)
        records.append(_record(entry, state, monitor))
        anchors |= _saved_anchor_names(state)
    return [r if storage.basename(r.path) not in anchors else _tag_anchor(r) for r in records]


def _tag_anchor(record: CheckpointRecord) -> CheckpointRecord:
    return CheckpointRecord(**{**record.__dict__, "tags": record.tags | {ANCHOR}})


def _record(entry: storage.Entry, state: Optional[dict], monitor: Optional[str]) -> CheckpointRecord:
    step = parse_rolling_name(entry.path)
    owned = step is not None and owned_record((state or {}).get("retention"), entry.path) is not None
    if step is None:
        step = step_in_name(entry.path) or 0
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
