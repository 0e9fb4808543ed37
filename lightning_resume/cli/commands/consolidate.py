"""``lightning-resume consolidate``: a sharded (DCP) checkpoint directory, or a dedupe checkpoint (one that
references blocks in ``blocks/``), -> one self-contained checkpoint file.

A dedupe checkpoint: every tensor read from the file or its pack and checked against its digest, then written
with the checkpoint's own tree text and no references (``cas.consolidate``): it loads bit for bit as the
original, and can be copied anywhere alone. A sharded directory:

Loads every shard in this one process (DCP reshards to full tensors; pickle-restricted reader, the
directory's commit marker and digests verified first), adds the non-sharded part (loop counters,
callback state, RNG streams), and writes the whole tree with ``lightning_resume.format.write.save_file``:
the same safetensors + typed JSON format, integrity record and atomic commit as
``SafetensorsCheckpointIO``, so ``lightning-resume verify`` / ``inspect`` and that plugin read it.
Tensors are named by their path (``state_dict.net.0.weight``). Needs memory for the whole state.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict

import torch

from lightning_resume.cas.consolidate import consolidate_file
from lightning_resume.cli.render import iter_leaves
from lightning_resume.format.write import save_file
from lightning_resume.storage import files as storage


def consolidate(directory: str, out: str) -> Dict[str, Any]:
    """Write ``out`` from ``directory``; return a summary (tensors, bytes)."""
    from lightning_resume.sharded.api import load_full, load_meta  # DCP is imported only for this command

    state: Dict[str, Any] = load_full(directory)  # verifies the marker and every digest first
    tree = {**(load_meta(directory) or {}), **state}
    save_file(tree, out)
    tensors = [leaf for _, leaf in iter_leaves(tree) if isinstance(leaf, torch.Tensor)]
    return {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors)}


def run(args: argparse.Namespace) -> int:
    if storage.is_dir(args.source):
        summary = consolidate(args.source, args.out)
    else:
        summary = consolidate_file(args.source, args.out)
    print(f"{args.out}: {summary['tensors']} tensors, {summary['bytes'] / 1e6:.1f} MB from {args.source}")
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "consolidate",
        help="sharded (DCP) checkpoint directory, or dedupe checkpoint -> one self-contained safetensors checkpoint",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("source", help="a committed sharded checkpoint directory, or a dedupe checkpoint file")
    p.add_argument("out", help="output .safetensors file (readable by SafetensorsCheckpointIO)")
    p.set_defaults(func=run)
