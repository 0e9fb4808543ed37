"""``lightning-resume consolidate``: a sharded (DCP) checkpoint directory -> one full safetensors file.

Loads every shard in this one process (DCP reshards to full tensors; pickle-restricted reader, the
directory's commit marker and digests verified first), then writes one ``.safetensors`` file: each
tensor under its path (``state_dict.net.0.weight``, ``optimizer_0.state.net.0.weight.exp_avg``) and
the rest of the tree (loop counters, ``param_groups``, callback state) as typed JSON in the header
(``__metadata__["lightning_resume.tree"]``). Needs memory for the whole state.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict

from safetensors.torch import save_file

from lightning_resume.errors import LightningResumeError
from lightning_resume.sharded.api import load_full
from lightning_resume.sharded.meta import META_JSON, encode, read_meta

FORMAT = "lightning-resume/consolidated/1"


def consolidate(directory: str, out: str) -> Dict[str, Any]:
    """Write ``out`` from ``directory``; return a summary (tensors, bytes)."""
    state: Dict[str, Any] = load_full(directory)
    if os.path.exists(os.path.join(directory, META_JSON)):
        state = {**read_meta(directory), **state}
    tree, tensors = encode(state)
    metadata = {"format": FORMAT, "lightning_resume.tree": json.dumps(tree)}
    tmp = f"{out}.tmp"
    save_file(tensors, tmp, metadata=metadata)
    os.replace(tmp, out)
    return {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def run(args: argparse.Namespace) -> int:
    try:
        summary = consolidate(args.sharded_dir, args.out)
    except LightningResumeError as err:
        print(f"lightning-resume consolidate: {err}", file=sys.stderr)
        return 1
    print(f"{args.out}: {summary['tensors']} tensors, {summary['bytes'] / 1e6:.1f} MB from {args.sharded_dir}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("consolidate", help="sharded (DCP) checkpoint directory -> one safetensors file",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("sharded_dir", help="a committed sharded checkpoint directory")
    p.add_argument("out", help="output .safetensors file")
    p.set_defaults(func=run)
