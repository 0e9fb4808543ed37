"""``lightning-resume prune DIR``: apply (or, with ``--dry-run``, explain) a retention policy to a directory.

This module turns files into ``CheckpointRecord``s (step from the name, metric and anchor tags from the
checkpoint's own ``ModelCheckpoint`` state when it loads with ``weights_only=True``) and prints the
decisions of ``RetentionPolicy``, the same code ``RetentionCheckpoint`` runs. It holds no keep rule. Then, as a run
does after each removal, it collects the packs of dedupe checkpoints (``cas.gc.collect``) of each lineage the
directory's checkpoints name: packs no checkpoint file references any more.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from lightning_resume.cas.gc import collect, lineage_of
from lightning_resume.durations import parse_duration
from lightning_resume.retention.policy import KeepDecision, RetentionPolicy
from lightning_resume.retention.records import records_in
from lightning_resume.sharded.commit import discard
from lightning_resume.storage import files as storage


def register(subparsers: Any) -> None:
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
    policy = _policy(args)
    if not storage.is_dir(args.dir):
        raise NotADirectoryError(f"{args.dir} is not a directory; pass a RetentionCheckpoint dirpath")
    decisions = policy.decide(records_in(args.dir, args.monitor))
    _print(decisions, args.json)
    if not args.dry_run:
        lineages = {lineage_of(d.record.path) for d in decisions}  # read before any file goes
        for decision in decisions:
            if not decision.keep:
                _remove(decision.record.path)
        for lineage in sorted(lin for lin in lineages if lin is not None):
            for pack in collect(args.dir, lineage):
                print(f"removed pack {pack}: no checkpoint references it", file=sys.stderr if args.json else sys.stdout)
    return 0


def _remove(path: str) -> None:
    """A file, or a sharded checkpoint directory (its commit marker first, so it is never half "last");
    one already deleted (another prune of the same directory) is not an error: the decision is carried out."""
    if storage.is_local(path) and storage.is_dir(path):
        discard(storage.local_path(path))
    else:
        storage.remove(path)  # one object: deleted whole or not at all


def _policy(args: argparse.Namespace) -> RetentionPolicy:
    seconds = parse_duration(args.anchor_every, "--anchor-every") if args.anchor_every is not None else None
    return RetentionPolicy(args.keep_last, args.keep_best, args.mode, args.anchor_every_n_steps, seconds)


def _print(decisions: list[KeepDecision], as_json: bool) -> None:
    if as_json:
        rows = [
            {
                "path": d.record.path,
                "step": d.record.step,
                "metric": d.record.metric,
                "verified": d.record.verified,
                "keep": d.keep,
                "reasons": list(d.reasons),
            }
            for d in decisions
        ]
        print(json.dumps(rows, indent=2))
        return
    for d in decisions:
        metric = "-" if d.record.metric is None else f"{d.record.metric:.6g}"
        verdict = "keep  " if d.keep else "delete"
        print(
            f"{verdict} {os.path.basename(d.record.path)}  step={d.record.step} metric={metric}  {'; '.join(d.reasons)}"
        )
