"""``lightning-resume convert OLD.ckpt NEW.safetensors``: rewrite a legacy ``torch.save`` checkpoint safely.

The old file is read with ``torch.load(weights_only=True)`` and Lightning's allowlist only; a file
that would need code to load is refused, never executed, naming what it holds. ``--no-weights-only`` (a
file you trust, as ``trainer.fit(..., weights_only=False)``) unpickles it in full. Hyper-parameters that
have no pickle-free encoding (an ``nn.Module``, a ``functools.partial``: ``format.hparams``) are then refused all
at once, naming their key paths; ``--drop KEY.PATH`` leaves each out of the new file (pass it again to
``load_from_checkpoint``, as after ``save_hyperparameters(ignore=[...])``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, Sequence

from lightning_resume.cli.commands.verify import add_weights_only_option
from lightning_resume.cli.render import tensor_groups
from lightning_resume.errors import UnencodableValueError, hparam_name
from lightning_resume.format import hparams
from lightning_resume.format.integrity import ALGORITHMS, DEFAULT_ALGORITHM
from lightning_resume.format.read import load_file
from lightning_resume.format.write import save_file


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
    add_weights_only_option(p)
    p.add_argument(
        "--drop",
        action="append",
        default=[],
        metavar="KEY.PATH",
        help="leave this value out of the new file (dict keys joined by dots, e.g. hyper_parameters.net); repeatable",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def drop(checkpoint: Dict[str, Any], key_paths: Sequence[str]) -> None:
    """Remove each dotted ``key_paths`` entry from ``checkpoint``; ``KeyError`` naming one that is not there."""
    for key_path in key_paths:
        *parents, last = key_path.split(".")
        node: Any = checkpoint
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict) or last not in node:
            raise KeyError(f"--drop {key_path}: the checkpoint has no such key")
        del node[last]


def refuse_hparams(checkpoint: Dict[str, Any], old: str) -> None:
    """Every hyper-parameter the new file cannot hold, at once, with the ``--drop`` that converts anyway."""
    found = hparams.unencodable(checkpoint)
    if not found:
        return
    paths = [f"{err.key_path.split('.')[0]}.{hparam_name(err.key_path)}" for err in found]
    first = found[0]
    raise UnencodableValueError(
        first.key_path,
        first.type_name,
        first.reason,
        f"The hyper-parameters {', '.join(paths)} hold objects (an nn.Module, a functools.partial) with no encoding"
        " that loads without running code. Convert without them: lightning-resume convert"
        f" {old} NEW {' '.join('--drop ' + p for p in paths)} (then pass them to load_from_checkpoint, as after"
        " self.save_hyperparameters(ignore=[...])).",
    )


def run(args: argparse.Namespace) -> int:
    loaded = load_file(args.old, weights_only=args.weights_only)
    try:
        drop(loaded.checkpoint, args.drop)
    except KeyError as err:
        raise ValueError(err.args[0]) from err
    refuse_hparams(loaded.checkpoint, args.old)
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
