"""``lightning-resume inspect FILE``: what a checkpoint holds, without the model that wrote it; for a dedupe
checkpoint also its own bytes and those it shares with the other checkpoints of its directory (``cas.usage``)."""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict

from lightning_resume.cas.usage import usage
from lightning_resume.cli.commands.diff import require
from lightning_resume.cli.render import describe
from lightning_resume.exact.state.describe import describe_exact_state
from lightning_resume.format.read import load_file


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "inspect", help="show step, epoch, versions, state parts and tensor sizes of a checkpoint"
    )
    p.add_argument("file", help="checkpoint file (safetensors or legacy torch.save)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    loaded = load_file(require(args.file), verify=False, lenient=True, mmap=True)
    info = describe(args.file, loaded)
    callbacks = loaded.checkpoint.get("callbacks")
    info["dedupe"] = usage(args.file) if loaded.header is not None else {}
    info["exact_resume"] = describe_exact_state(callbacks.get("ExactResume")) if isinstance(callbacks, dict) else None
    print(json.dumps(info, indent=2, default=str) if args.json else render(info))
    return 0


def render(info: Dict[str, Any]) -> str:
    lines = [
        f"file:     {info['path']} ({info['file_bytes']:,} bytes, {info['format']})",
        f"epoch:    {info['epoch']}    global_step: {info['global_step']}",
        f"lightning: {info['pytorch-lightning_version']}",
        f"keys:     {', '.join(info['top_level_keys'])}",
    ]
    for name, keys in info["callbacks"].items():
        lines.append(f"callback  {name}: {', '.join(keys) or '(empty)'}")
    lines += _render_dedupe(info.get("dedupe") or {})
    lines += _render_exact(info.get("exact_resume"))
    lines.append("tensors by group:")
    for group, g in sorted(info["tensor_groups"].items()):
        lines.append(f"  {group:<24} {g['tensors']:>6} tensors {g['bytes']:>16,} bytes")
    return "\n".join(lines)


def _render_dedupe(dedupe: Dict[str, Any]) -> list:
    """Own vs shared bytes of a dedupe checkpoint (``cas.usage``); nothing for a self-contained file."""
    if not dedupe:
        return []
    return [
        f"dedupe:   lineage {dedupe['lineage']}: {dedupe['referenced_tensors']} tensors"
        f" ({dedupe['referenced_bytes']:,} bytes) referenced in {len(dedupe['packs'])} pack(s)",
        f"  own     {dedupe['own_bytes']:>16,} bytes (this file {dedupe['file_bytes']:,} + blocks no other"
        " checkpoint here references: freed when it goes)",
        f"  shared  {dedupe['shared_bytes']:>16,} bytes (blocks other checkpoints here reference too)",
    ]


def _render_exact(exact: Any) -> list:
    if exact is None:
        return ["exact resume: no ExactResume state (RNG streams and data position are not saved)"]
    lines = [f"exact resume: format {exact['format']}, world size {exact['world_size']}"]
    for r in exact["ranks"]:
        lines.append(f"  rank {r['rank']}: RNG {', '.join(r['rng_streams'])}")
        lines.append(
            f"    data: {'; '.join(r['loader_positions']) or 'no train loader'}; prefetched {r['prefetched_batches']};"
            f" epoch exhausted {r['epoch_exhausted']}; validation pending {r['validation_pending']}"
        )
        if r["fingerprint"]:
            lines.append("    fingerprint: " + ", ".join(f"{k}={v}" for k, v in sorted(r["fingerprint"].items())))
    return lines
