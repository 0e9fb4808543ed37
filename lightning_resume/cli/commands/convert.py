"""``lightning-resume convert OLD.ckpt NEW.safetensors``: rewrite a legacy ``torch.save`` checkpoint safely.

The old file is read with ``torch.load(weights_only=True)`` and Lightning's allowlist only; a file
that would need code to load is refused, never executed.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from lightning_resume.cli.render import tensor_groups
from lightning_resume.io.integrity import ALGORITHMS, DEFAULT_ALGORITHM
from lightning_resume.io.read import load_file
from lightning_resume.io.write import save_file


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("convert", help="convert a legacy torch.save checkpoint to the safetensors format")
    p.add_argument("old", help="legacy checkpoint (torch.save zip or pickle)")
    p.add_argument("new", help="path of the new checkpoint (any extension; *.ckpt works with ModelCheckpoint)")
    p.add_argument(
        "--checksum",
        choices=ALGORITHMS,
        default=DEFAULT_ALGORITHM,
        help=f"digest recorded in the new file (default {DEFAULT_ALGORITHM}; sha256 if you need a cryptographic one)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    loaded = load_file(args.old)
    save_file(loaded.checkpoint, args.new, algorithm=args.checksum)
    groups = tensor_groups(loaded.checkpoint)
    summary = {
        "source": args.old,
        "target": args.new,
        "source_format": "safetensors" if loaded.header else "torch.save",
        "tensors": sum(g["tensors"] for g in groups.values()),
        "bytes": sum(g["bytes"] for g in groups.values()),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"converted {args.old} ({summary['source_format']}) -> {args.new}: {summary['tensors']} tensors, {summary['bytes']:,} bytes"
        )
    return 0
