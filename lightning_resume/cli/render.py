"""Plain-data views of a loaded checkpoint for the ``inspect``/``verify``/``diff`` commands.

Everything here takes a checkpoint dict (already loaded and verified by ``files``) and returns JSON-
able dicts; printing belongs to the commands. No Lightning imports, no file writes.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from lightning_resume.format.read import Loaded

TOP_KEYS = ("epoch", "global_step", "pytorch-lightning_version")


def iter_leaves(tree: Any, path: str = "") -> Iterator[Tuple[str, Any]]:
    """``(dotted key path, leaf)`` for every non-container value, tensors included."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from iter_leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(tree, (list, tuple)) and not isinstance(tree, torch.Size):
        for i, v in enumerate(tree):
            yield from iter_leaves(v, f"{path}.{i}" if path else str(i))
    else:
        yield path, tree


def group_of(path: str) -> str:
    return path.split(".", 1)[0]


def tensor_groups(checkpoint: Dict[str, Any]) -> Dict[str, Dict[str, int]]:
    """Per top-level key: how many distinct tensors and how many bytes."""
    groups: Dict[str, Dict[str, int]] = {}
    seen = set()
    for path, leaf in iter_leaves(checkpoint):
        if isinstance(leaf, torch.Tensor) and id(leaf) not in seen:
            seen.add(id(leaf))
            g = groups.setdefault(group_of(path), {"tensors": 0, "bytes": 0})
            g["tensors"] += 1
            g["bytes"] += leaf.numel() * leaf.element_size()
    return groups


def describe(path: str, loaded: Loaded) -> Dict[str, Any]:
    """What ``inspect`` reports: counters, versions, state parts present, tensors by group."""
    ck = loaded.checkpoint
    raw_callbacks = ck.get("callbacks")
    callbacks = raw_callbacks if isinstance(raw_callbacks, dict) else {}
    return {
        "path": path,
        "format": "safetensors" if loaded.header is not None else "torch.save (legacy pickle)",
        "file_bytes": loaded.size,
        **{k: ck.get(k) for k in TOP_KEYS},
        "top_level_keys": [str(k) for k in ck],
        "callbacks": {str(name): _keys(state) for name, state in callbacks.items()},
        "tensor_groups": tensor_groups(ck),
    }


def _keys(state: Any) -> List[str]:
    return [str(k) for k in state] if isinstance(state, dict) else [type(state).__name__]


def diff(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    """Keys added/removed/changed from ``a`` to ``b`` and the largest |a-b| per tensor group."""
    la, lb = dict(iter_leaves(a)), dict(iter_leaves(b))
    changed: List[str] = []
    max_abs: Dict[str, float] = {}
    for key in sorted(la.keys() & lb.keys()):
        same, delta = _compare(la[key], lb[key])
        if not same:
            changed.append(key)
        if delta is not None:
            group = group_of(key)
            max_abs[group] = max(max_abs.get(group, 0.0), delta)
    return {
        "added": sorted(lb.keys() - la.keys()),
        "removed": sorted(la.keys() - lb.keys()),
        "changed": changed,
        "max_abs_diff": max_abs,
    }


def _compare(x: Any, y: Any) -> Tuple[bool, Optional[float]]:
    """(identical?, max abs difference if both are tensors of one shape, else None)."""
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        if x.dtype != y.dtype or x.shape != y.shape:
            return False, None
        same = _bits(x) == _bits(y)
        if x.numel() == 0 or x.dtype == torch.bool:
            return same, 0.0 if same else None
        xd, yd = x.detach().cpu().double(), y.detach().cpu().double()
        delta = torch.where((xd == yd) | (xd.isnan() & yd.isnan()), 0.0, (xd - yd).abs())
        d = delta.max().item()
        return same, (math.inf if math.isnan(d) else d)
    if type(x) is not type(y):
        return False, None
    if isinstance(x, float) and math.isnan(x) and math.isnan(y):
        return True, None
    try:
        return bool(x == y), None
    except (TypeError, ValueError, RuntimeError):
        return repr(x) == repr(y), None


def _bits(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
