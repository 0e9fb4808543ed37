"""``lightning-resume export``: model weights only, in bf16 (or fp16/fp32), as safetensors for inference.

Reads a sharded checkpoint directory (verified, pickle-restricted, resharded to full tensors in
this process) or a single checkpoint file (``torch.load(weights_only=True)``: no code runs). Takes
the model state (``state_dict``, else ``model``), casts floating tensors to ``--dtype`` and leaves
integer buffers as they are. Optimizer state and everything else is dropped.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from typing import Dict

import torch
from safetensors.torch import save_file

from lightning_resume.errors import LightningResumeError, UnsafeCheckpointError
from lightning_resume.sharded.api import load_full

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODEL_KEYS = ("state_dict", "model")


def model_state(path: str) -> Dict[str, torch.Tensor]:
    if os.path.isdir(path):
        state = load_full(path)
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(path, f"needs code to load (not weights-only safe): {err}") from err
    for key in MODEL_KEYS:
        if isinstance(state.get(key), dict):
            state = state[key]
            break
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise LightningResumeError(f"{path}: no model weights found (looked for {' / '.join(MODEL_KEYS)})")
    return tensors


def export(path: str, out: str, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    weights = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in model_state(path).items()}
    tmp = f"{out}.tmp"
    save_file(weights, tmp, metadata={"format": "pt", "source": os.path.basename(os.path.normpath(path))})
    os.replace(tmp, out)
    return weights


def run(args: argparse.Namespace) -> int:
    try:
        weights = export(args.checkpoint, args.out, DTYPES[args.dtype])
    except LightningResumeError as err:
        print(f"lightning-resume export: {err}", file=sys.stderr)
        return 1
    size = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"{args.out}: {len(weights)} tensors, {size / 1e6:.1f} MB ({args.dtype})")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("export", help="model weights only (bf16) as safetensors, for inference",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="sharded checkpoint directory or Lightning .ckpt file")
    p.add_argument("out", help="output .safetensors file")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="floating-point dtype (default bf16)")
    p.set_defaults(func=run)
