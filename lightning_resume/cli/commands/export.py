"""``lightning-resume export``: model weights only, in bf16 (or fp16/fp32), as safetensors for inference.

Reads any checkpoint this product reads, with no code run: a sharded checkpoint directory (verified,
pickle-restricted, resharded to full tensors in this process), a ``SafetensorsCheckpointIO`` file
(checksums verified), or a ``torch.save`` ``.ckpt`` (``lightning_resume.format.legacy``: weights-only
unpickling plus the few Lightning classes real checkpoints hold, e.g. ``AttributeDict`` hparams).
Takes the model state (``state_dict``, else ``model``), casts floating tensors to ``--dtype`` and
leaves integer buffers as they are; optimizer state and everything else is dropped. The output is a
plain safetensors file (any safetensors reader loads it), committed with ``format.atomic.atomic_write``.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict

import torch
from safetensors.torch import save as safetensors_bytes

from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.format.atomic import atomic_write
from lightning_resume.format.read import load_file
from lightning_resume.storage import files as storage

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODEL_KEYS = ("state_dict", "model")


def read_checkpoint(path: str) -> Dict[str, Any]:
    """The checkpoint tree of a sharded directory or of a file of either format (content decides)."""
    if storage.is_dir(path):
        from lightning_resume.sharded.api import load_full  # DCP is imported only for sharded checkpoints

        return load_full(path)
    return load_file(path).checkpoint


def model_state(path: str) -> Dict[str, torch.Tensor]:
    state = read_checkpoint(path)
    for key in MODEL_KEYS:
        if isinstance(state.get(key), dict):
            state = state[key]
            break
    tensors = {str(k): v for k, v in state.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise CheckpointCorruptError(path, f"no model weights found (looked for {' / '.join(MODEL_KEYS)})")
    return tensors


def export(path: str, out: str, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    weights = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in model_state(path).items()}
    data = safetensors_bytes(weights, metadata={"format": "pt", "source": storage.basename(str(path).rstrip("/"))})
    atomic_write(out, lambda handle: handle.write(data))
    return weights


def run(args: argparse.Namespace) -> int:
    weights = export(args.checkpoint, args.out, DTYPES[args.dtype])
    size = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"{args.out}: {len(weights)} tensors, {size / 1e6:.1f} MB ({args.dtype})")
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "export", help="model weights only (bf16) as safetensors, for inference", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("checkpoint", help="sharded checkpoint directory, SafetensorsCheckpointIO file or Lightning .ckpt")
    p.add_argument("out", help="output .safetensors file")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="floating-point dtype (default bf16)")
    p.set_defaults(func=run)
