"""Bitwise comparison of checkpoint trees: ``assert_same`` (type for type, the io tests) and
``assert_bitwise`` (tensors bit for bit inside nested dicts/lists, the exactness and sharded tests)."""

from __future__ import annotations

import argparse
import math
import struct
from typing import Any

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


def assert_bitwise(a: Any, c: Any, where: str = "") -> None:
    """Nested dicts/lists/tuples of tensors and plain values, equal bit for bit (dtype and shape too)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(c, torch.Tensor) and a.dtype == c.dtype and a.shape == c.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), c.reshape(-1).view(torch.uint8)), f"{where}: bits differ"
    elif isinstance(a, dict):
        assert set(a) == set(c), f"{where}: keys {sorted(a)} != {sorted(c)}"
        for k in a:
            assert_bitwise(a[k], c[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(c), where
        for i, (x, y) in enumerate(zip(a, c)):
            assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == c, f"{where}: {a!r} != {c!r}"
