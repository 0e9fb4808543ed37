"""``lightning-resume prune DIR``: apply (or, with ``--dry-run``, explain) a retention policy to a directory.

This module turns files into ``CheckpointRecord``s (step from the name, metric and anchor tags from the
checkpoint's own ``ModelCheckpoint`` state when it loads with ``weights_only=True``) and prints the
decisions of ``RetentionPolicy``, the same code ``RetentionCheckpoint`` runs. It holds no keep rule.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from typing import Optional

from lightning_resume.durations import parse_duration
from lightning_resume.errors import ConfigurationError
from lightning_resume.retention import files
from lightning_resume.retention.policy import ANCHOR, CheckpointRecord, RetentionPolicy

_ANY_STEP = re.compile(r"step=(\d+)")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("prune", help="keep/delete checkpoints in DIR by a retention policy, with reasons")
    parser.add_argument("dir", metavar="DIR", help="checkpoint directory (a RetentionCheckpoint dirpath)")
    parser.add_argument("--keep-last", type=int, default=None, metavar="N", help="keep the N most recent")
    parser.add_argument("--keep-best", type=int, default=None, metavar="N", help="keep the N best by --monitor")
    parser.add_argument("--monitor", default=None, metavar="KEY", help="metric key (default: the one saved)")
    parser.add_argument("--mode", choices=("min", "max"), default="min", help="direction of --monitor")
    parser.add_argument("--anchor-every-n-steps", type=int, default=None, metavar="K", help="permanent anchors")
    parser.add_argument("--anchor-every", default=None, metavar="DURATION", help="wall-time anchors, e.g. 6h")
    parser.add_argument("--dry-run", action="store_true", help="print decisions, delete nothing")
    parser.add_argument("--json", action="store_true", help="print decisions as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        policy = _policy(args)
    except (ConfigurationError, ValueError) as err:
        print(f"lightning-resume prune: {err}")
        return 2
    if not os.path.isdir(args.dir):
        print(f"lightning-resume prune: {args.dir} is not a directory; pass a RetentionCheckpoint dirpath")
        return 2
    decisions = policy.decide(records_in(args.dir, args.monitor))
    _print(decisions, args.json)
    if not args.dry_run:
        for decision in decisions:
            if not decision.keep:
                _remove(decision.record.path)
    return 0


def _remove(path: str) -> None:
    """A file, or a sharded checkpoint directory (its commit marker first, so it is never half "last")."""
    if os.path.isdir(path):
        from lightning_resume.sharded.strategy import ShardedCheckpointIO

        ShardedCheckpointIO().remove_checkpoint(path)
    else:
        os.remove(path)


def _policy(args: argparse.Namespace) -> RetentionPolicy:
    seconds = parse_duration(args.anchor_every, "--anchor-every") if args.anchor_every is not None else None
    return RetentionPolicy(args.keep_last, args.keep_best, args.mode, args.anchor_every_n_steps, seconds)


def records_in(dirpath: str, monitor: Optional[str] = None) -> list:
    """One record per ``.ckpt`` file in ``dirpath``; anchor tags carried over from the newest saved state."""
    records, anchors = [], set()
    for entry in files.list_checkpoint_files(dirpath):
        state = files.read_checkpoint_callback_state(entry.path)
        records.append(_record(entry, state, monitor))
        saved = (state or {}).get("retention", {}).get("records", [])
        anchors |= {os.path.basename(s["path"]) for s in saved if ANCHOR in s.get("tags", ())}
    return [r if os.path.basename(r.path) not in anchors else _tag_anchor(r) for r in records]


def _tag_anchor(record: CheckpointRecord) -> CheckpointRecord:
    return CheckpointRecord(**{**record.__dict__, "tags": record.tags | {ANCHOR}})


def _record(entry: files.FileEntry, state: Optional[dict], monitor: Optional[str]) -> CheckpointRecord:
    step = files.parse_rolling_name(entry.path)
    owned = step is not None
    if step is None:
        match = _ANY_STEP.search(os.path.basename(entry.path))
        step = int(match.group(1)) if match else 0
    metric = _metric(state, monitor)
    verified = files.verify_problem(entry.path) is None
    return CheckpointRecord(entry.path, step, 0, entry.mtime, metric, frozenset(), verified, False, owned)


def _metric(state: Optional[dict], monitor: Optional[str]) -> Optional[float]:
    if not state or state.get("current_score") is None:
        return None
    if monitor is not None and state.get("monitor") != monitor:
        return None
    value = float(state["current_score"])
    return None if math.isnan(value) else value


def _print(decisions: list, as_json: bool) -> None:
    if as_json:
        rows = [
            {"path": d.record.path, "step": d.record.step, "metric": d.record.metric,
             "verified": d.record.verified, "keep": d.keep, "reasons": list(d.reasons)}
            for d in decisions
        ]
        print(json.dumps(rows, indent=2))
        return
    for d in decisions:
        metric = "-" if d.record.metric is None else f"{d.record.metric:.6g}"
        verdict = "keep  " if d.keep else "delete"
        print(f"{verdict} {os.path.basename(d.record.path)}  step={d.record.step} metric={metric}  {'; '.join(d.reasons)}")
