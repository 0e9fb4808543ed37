"""``lightning-resume verify FILE|DIR``: check every checksum; non-zero exit naming the bad file and tensor."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, List

from lightning_resume.errors import LightningResumeError
from lightning_resume.io.files import verify_file
from lightning_resume.io.last import CHECKPOINT_SUFFIXES


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("verify", help="verify checksums of a checkpoint file or of every checkpoint in a directory")
    p.add_argument("target", help="a checkpoint file, or a directory of *.ckpt / *.safetensors files")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def candidates(target: str) -> List[str]:
    if not os.path.isdir(target):
        return [target]
    names = sorted(n for n in os.listdir(target) if n.endswith(CHECKPOINT_SUFFIXES) and not n.startswith("."))
    return [os.path.join(target, n) for n in names]


def check(path: str) -> Dict[str, Any]:
    try:
        verify_file(path)
    except (LightningResumeError, OSError) as err:
        return {"path": path, "ok": False, "error": str(err)}
    return {"path": path, "ok": True, "error": None}


def run(args: argparse.Namespace) -> int:
    results = [check(p) for p in candidates(args.target)]
    if args.json:
        print(json.dumps({"results": results, "ok": bool(results) and all(r["ok"] for r in results)}, indent=2))
    elif not results:
        print(f"no checkpoint files (*.ckpt, *.safetensors) in {args.target}")
    for r in results if not args.json else []:
        print(f"OK    {r['path']}" if r["ok"] else f"FAIL  {r['error']}")
    if not results:
        return 2
    return 0 if all(r["ok"] for r in results) else 1
