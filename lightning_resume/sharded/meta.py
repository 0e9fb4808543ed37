"""Pickle-free storage of the non-sharded part of a checkpoint (loop counters, callback state, RNG...).

Lightning's own ``ModelParallelStrategy`` writes this part with ``torch.save`` (``meta.pt``, a
pickle). Here it becomes two files written by rank 0: ``meta.json`` (the tree, typed JSON) and
``meta.safetensors`` (its tensors and NumPy arrays). Containers keep their kind (tuple vs list),
dict keys keep their type and order. A value that has no pickle-free form is refused at save time
with the key that holds it. This module owns only the codec; it writes no marker and knows no DCP.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, Tuple

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from lightning_resume.errors import CheckpointCorruptError, LightningResumeError

META_JSON = "meta.json"
META_TENSORS = "meta.safetensors"
_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class UnencodableStateError(LightningResumeError, TypeError):
    """A checkpoint value has no pickle-free form (e.g. an arbitrary object in ``hyper_parameters``)."""

    def __init__(self, key: str, value: Any) -> None:
        self.key = key
        super().__init__(
            f"checkpoint value at {key!r} is a {type(value).__module__}.{type(value).__qualname__}, which cannot be"
            " stored without pickle; store it as numbers, strings, lists, dicts or tensors"
            " (e.g. save_hyperparameters(ignore=[...]) for objects)"
        )


def encode(tree: Any) -> Tuple[Any, Dict[str, torch.Tensor]]:
    tensors: Dict[str, torch.Tensor] = {}
    return _encode(tree, "", tensors), tensors


def _encode(value: Any, key: str, tensors: Dict[str, torch.Tensor]) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value if type(value) is int else int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, torch.Tensor):
        return {"tensor": _put(tensors, key, value.detach().cpu().contiguous().clone())}
    if isinstance(value, np.ndarray):
        return {"ndarray": _put(tensors, key, torch.from_numpy(np.ascontiguousarray(value).copy()))}
    if isinstance(value, np.generic):
        return {"npscalar": value.dtype.str, "value": _encode(value.item(), key, tensors)}
    if isinstance(value, (list, tuple)):
        items = [_encode(v, f"{key}[{i}]", tensors) for i, v in enumerate(value)]
        return items if isinstance(value, list) else {"tuple": items}
    if isinstance(value, dict):
        return {"dict": [[_encode(k, f"{key}<key>", tensors), _encode(v, f"{key}.{k}", tensors)] for k, v in value.items()]}
    raise UnencodableStateError(key.lstrip(".") or "<root>", value)


def _put(tensors: Dict[str, torch.Tensor], key: str, tensor: torch.Tensor) -> str:
    """Store under the value's path (``state_dict.net.0.weight``), made unique if two paths print alike."""
    name = key.lstrip(".") or "<root>"
    unique, n = name, 1
    while unique in tensors:
        unique, n = f"{name}#{n}", n + 1
    tensors[unique] = tensor
    return unique


def decode(encoded: Any, tensors: Dict[str, torch.Tensor]) -> Any:
    if isinstance(encoded, list):
        return [decode(v, tensors) for v in encoded]
    if not isinstance(encoded, dict):
        return encoded
    if "tensor" in encoded:
        return tensors[encoded["tensor"]]
    if "ndarray" in encoded:
        return tensors[encoded["ndarray"]].numpy()
    if "npscalar" in encoded:
        return np.dtype(encoded["npscalar"]).type(decode(encoded["value"], tensors))
    if "float" in encoded:
        return _FLOATS[encoded["float"]]
    if "tuple" in encoded:
        return tuple(decode(v, tensors) for v in encoded["tuple"])
    return {_hashable(decode(k, tensors)): decode(v, tensors) for k, v in encoded["dict"]}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def write_meta(tree: Any, directory: str) -> Tuple[str, str]:
    """Write ``meta.json`` and ``meta.safetensors`` into ``directory``; return their names."""
    encoded, tensors = encode(tree)
    save_file(tensors, os.path.join(directory, META_TENSORS))
    with open(os.path.join(directory, META_JSON), "w", encoding="utf-8") as handle:
        json.dump(encoded, handle)
        handle.flush()
        os.fsync(handle.fileno())
    return META_JSON, META_TENSORS


def read_meta(directory: str) -> Any:
    path = os.path.join(directory, META_JSON)
    try:
        with open(path, encoding="utf-8") as handle:
            encoded = json.load(handle)
        return decode(encoded, load_file(os.path.join(directory, META_TENSORS)))
    except (OSError, ValueError, KeyError, TypeError, IndexError) as err:
        raise CheckpointCorruptError(path, f"unreadable checkpoint metadata: {err}") from err
