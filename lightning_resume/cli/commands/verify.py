"""``lightning-resume verify FILE|DIR``: check everything a checkpoint holds; exit 1 naming what is bad.

A file is checked whole (every checksum, the tree); a sharded checkpoint directory is checked whole
(its commit marker and the digest of every shard it lists). A directory of checkpoints has each one
checked, and the newest that verifies is named: what ``ckpt_path="last"`` would resume from. The
checks are ``lightning_resume.io.verify``'s, the same the plugin, retention and "last" resolution run.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from lightning_resume.io import remote
from lightning_resume.io.resolve import CHECKPOINT_SUFFIXES, newest_verified
from lightning_resume.io.verify import problem
from lightning_resume.sharded.commit import is_sharded_checkpoint


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "verify", help="verify a checkpoint (file or sharded directory) or every checkpoint in a directory"
    )
    p.add_argument("target", help="a checkpoint file, a sharded checkpoint directory, or a directory of checkpoints")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def candidates(target: str) -> list[str]:
    """The checkpoints ``target`` names: itself, or the checkpoints directly inside a directory of them."""
    if remote.is_remote(target):  # a URL: listed through fsspec, scheme kept (sharded directories are local-only)
        if not remote.is_dir(target):
            if not remote.exists(target):
                raise FileNotFoundError(f"{target}: no such file or directory")
            return [target]
        entries = sorted(remote.list_dir(target), key=lambda e: e.name)
        return [e.path for e in entries if not e.name.startswith(".") and e.name.endswith(CHECKPOINT_SUFFIXES)]
    if not os.path.exists(target):
        raise FileNotFoundError(f"{target}: no such file or directory")
    if not os.path.isdir(target) or is_sharded_checkpoint(target):
        return [target]
    names = sorted(n for n in os.listdir(target) if not n.startswith("."))
    paths = [os.path.join(target, n) for n in names]
    return [p for p in paths if p.endswith(CHECKPOINT_SUFFIXES) or is_sharded_checkpoint(p)]


def run(args: argparse.Namespace) -> int:
    paths = candidates(args.target)
    if not paths:
        raise FileNotFoundError(
            f"{args.target}: no checkpoints in this directory (*.ckpt, *.safetensors files or sharded directories)"
        )
    checked = [(p, problem(p)) for p in paths]
    results = [{"path": p, "ok": why is None, "error": why} for p, why in checked]
    good = {p for p, why in checked if why is None}
    newest = newest_verified(good, verify=lambda path: None) if len(paths) > 1 else None
    ok = all(r["ok"] for r in results)
    if args.json:
        print(json.dumps({"results": results, "ok": ok, "newest_verified": newest}, indent=2))
    else:
        for r in results:
            print(f"OK    {r['path']}" if r["ok"] else f"FAIL  {r['error']}")
        if newest is not None:
            print(f"newest verified: {newest}")
    return 0 if ok else 1
