"""``lightning-resume diff A B``: keys added, removed and changed, largest difference per tensor group."""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict

from lightning_resume.cli.render import diff
from lightning_resume.format.read import load_file
from lightning_resume.storage import files as storage


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("diff", help="compare two checkpoints key by key")
    p.add_argument("a", help="first checkpoint")
    p.add_argument("b", help="second checkpoint")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    a = load_file(require(args.a), lenient=True, mmap=True).checkpoint
    b = load_file(require(args.b), lenient=True, mmap=True).checkpoint
    result = diff(a, b)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


def require(path: str) -> str:
    """``path`` if it exists; else ``FileNotFoundError`` naming it whole (s3fs names only the bucket key)."""
    if not storage.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    return path


def render(result: Dict[str, Any]) -> str:
    lines = []
    for label in ("added", "removed", "changed"):
        keys = result[label]
        lines.append(f"{label} ({len(keys)}):")
        lines.extend(f"  {k}" for k in keys)
    lines.append("largest absolute difference per tensor group:")
    lines.extend(f"  {g:<24} {v:.6g}" for g, v in sorted(result["max_abs_diff"].items()))
    if not any(result[k] for k in ("added", "removed", "changed")):
        lines.append("identical")
    return "\n".join(lines)
