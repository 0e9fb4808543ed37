"""A small fingerprint of training state: one digest per part (weights, optimizer, RNG, data, step).

Saved with every checkpoint and recomputed after restore, so a resume that did not restore what was
saved is caught at once instead of showing up as a drifting loss curve. Pure hashing over values;
no Lightning, no files.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Mapping, Optional

import torch


def _feed(h: hashlib.blake2b, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj  # a DTensor: this rank's shard
        t = local.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)}".encode())
        if t.numel():
            h.update(memoryview(t.view(torch.uint8).numpy().data))
    elif isinstance(obj, Mapping):
        h.update(b"{")
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode())
            _feed(h, obj[key])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[" if isinstance(obj, list) else b"(")
        for item in obj:
            _feed(h, item)
        h.update(b"]")
    else:
        h.update(repr(obj).encode())


def digest(obj: Any) -> str:
    """Hex digest of a nested structure of tensors, mappings, sequences and plain values."""
    h = hashlib.blake2b(digest_size=16)
    _feed(h, obj)
    return h.hexdigest()


BUFFER_PREFIX = "buffer:"
"""Parts named ``buffer:<name>``: a module buffer registered with ``persistent=False``, which no checkpoint
holds; the resumed run rebuilds it, and it must come out equal to what the saving run had."""


def fingerprint(
    model_state: Mapping[str, torch.Tensor],
    optimizer_states: Iterable[Mapping[str, Any]],
    rng: Any,
    data: Any,
    step: int,
    unsaved_buffers: Optional[Mapping[str, torch.Tensor]] = None,
) -> dict[str, str]:
    """The fingerprint of one rank's training state, one digest per part (and per unsaved buffer)."""
    return {
        "weights": digest(model_state),
        "optimizer": digest(list(optimizer_states)),
        "rng": digest(rng),
        "data": digest(data),
        "step": str(int(step)),
        **{BUFFER_PREFIX + name: digest(buffer) for name, buffer in (unsaved_buffers or {}).items()},
    }


def fingerprint_mismatches(saved: Mapping[str, str], restored: Mapping[str, str], parts: Iterable[str]) -> list[str]:
    """Lines naming each part whose restored digest differs from the saved one."""
    return [
        f"{part}: saved {saved.get(part)}, restored {restored.get(part)}"
        for part in parts
        if part in saved and saved.get(part) != restored.get(part)
    ]


def unsaved_buffer_mismatches(saved: Mapping[str, str], restored: Mapping[str, str]) -> list[str]:
    """Names of the non-persistent buffers whose value after restore differs from the saving run's."""
    return [
        part[len(BUFFER_PREFIX) :]
        for part in saved
        if part.startswith(BUFFER_PREFIX) and saved[part] != restored.get(part)
    ]
