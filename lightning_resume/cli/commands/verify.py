"""``lightning-resume verify FILE|DIR``: check everything a checkpoint holds; exit 1 naming what is bad.

A file is checked whole (every checksum, the tree); a sharded checkpoint directory is checked whole
(its commit marker and the digest of every shard it lists). A directory of checkpoints has each one
checked, and the newest that verifies is named: what ``ckpt_path="last"`` would resume from. The
checks are ``lightning_resume.io.verify``'s, the same the plugin, retention and "last" resolution run.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from lightning_resume import storage
from lightning_resume.io.marker import is_sharded_checkpoint
from lightning_resume.io.resolve import candidates, newest_verified
from lightning_resume.io.verify import problem


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "verify", help="verify a checkpoint (file or sharded directory) or every checkpoint in a directory"
    )
    p.add_argument("target", help="a checkpoint file, a sharded checkpoint directory, or a directory of checkpoints")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def targets(target: str) -> list[str]:
    """The checkpoints ``target`` names: itself (a file or a sharded directory), or the checkpoints of a
    directory of them (``io.resolve.candidates``, the rule "last" resolution and retention use)."""
    if not storage.exists(target) and not storage.is_dir(target):  # an object-store prefix is no object
        raise FileNotFoundError(f"{target}: no such file or directory")
    if not storage.is_dir(target) or is_sharded_checkpoint(target):
        return [target]
    return [e.path for e in candidates(target)]


def run(args: argparse.Namespace) -> int:
    paths = targets(args.target)
    if not paths:
        raise FileNotFoundError(
            f"{args.target}: no checkpoints in this directory (*.ckpt, *.safetensors files or sharded directories)"
        )
    checked = [(p, problem(p)) for p in paths]
    results = [{"path": p, "ok": why is None, "error": why} for p, why in checked]
    good = {p for p, why in checked if why is None}
    newest = newest_verified(good, verify=lambda path: None) if len(paths) > 1 else None  # by training progress
    ok = all(r["ok"] for r in results)
    if args.json:
        print(json.dumps({"results": results, "ok": ok, "newest_verified": newest}, indent=2))
    else:
        for r in results:
            print(f"OK    {r['path']}" if r["ok"] else f"FAIL  {r['error']}")
        if newest is not None:
            print(f"newest verified: {newest}")
    return 0 if ok else 1
