"""Shared helpers for the io tests: type-for-type, bit-for-bit tree comparison and header surgery."""

from __future__ import annotations

import argparse
import json
import math
import struct
from typing import Any, Callable, Dict

import numpy as np
import torch


def tensor_bits(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_same(a: Any, b: Any, path: str = "<root>") -> None:
    """Equal type for type; tensors and floats bit for bit (NaN payloads and -0.0 included)."""
    assert type(a) is type(b), f"{path}: type {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad), path
        assert tensor_bits(a) == tensor_bits(b), f"{path}: tensor bytes differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b)), f"{path}: {a} != {b}"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert type(k) is type(next(kk for kk in b if kk == k)), f"{path}: key type of {k!r}"
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, argparse.Namespace):
        assert_same(vars(a), vars(b), path)
    elif isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def rewrite_header(path: str, edit: Callable[[Dict[str, Any]], None], pad: bool = True) -> None:
    """Parse a safetensors header, apply ``edit`` to the JSON dict, write it back with a fixed length."""
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    doc = json.loads(raw[8 : 8 + n])
    edit(doc)
    new = json.dumps(doc).encode()
    if pad:
        new += b" " * (-len(new) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(new)) + new + raw[8 + n :])
