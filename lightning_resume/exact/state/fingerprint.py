"""A small fingerprint of training state: one digest per part (weights, optimizer, RNG, data, step).

Saved with every checkpoint and recomputed after restore, so a resume that did not restore what was
saved is caught at once instead of showing up as a drifting loss curve. The weights and optimizer parts,
the bulk of the bytes, may be left out at save (``fingerprint(model_state=None)``): a checkpoint format
that records and verifies every tensor's own digest (``SafetensorsCheckpointIO``) already proves the file
holds what was saved, and the restored state is then compared with the loaded checkpoint instead
(``tensor_digests``), once per resume rather than on the training thread at every save. Digests are
xxh3-128 (near memory speed on one core, as the file checksums); fingerprints written before carry no
``hash`` part and were blake2b, which ``digest`` still computes for them. Pure hashing over values; no
Lightning, no files.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Mapping, Optional, Protocol

import torch
import xxhash

HASH = "xxh3-128"
"""The digest of new fingerprints (recorded in them as ``hash``)."""
LEGACY_HASH = "blake2b"
"""The digest of fingerprints that name none."""


class _Hasher(Protocol):
    def update(self, data: Any) -> None: ...

    def hexdigest(self) -> str: ...


def _hasher(algorithm: str) -> _Hasher:
    if algorithm == HASH:
        return xxhash.xxh3_128()
    if algorithm == LEGACY_HASH:
        return hashlib.blake2b(digest_size=16)
    raise ValueError(f"unknown fingerprint hash {algorithm!r}: this version knows {HASH!r} and {LEGACY_HASH!r}")


def _feed(h: _Hasher, obj: Any) -> None:
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


def digest(obj: Any, algorithm: str = HASH) -> str:
    """Hex digest of a nested structure of tensors, mappings, sequences and plain values."""
    h = _hasher(algorithm)
    _feed(h, obj)
    return h.hexdigest()


def tensor_digests(state: Mapping[str, Any], algorithm: str = HASH) -> dict[str, str]:
    """One digest per entry of a model state dict: a loaded checkpoint's and the restored module's compare
    entry by entry, leaving out the ones a rank holds on purpose differently (``rank_local``)."""
    return {str(name): digest(value, algorithm) for name, value in state.items()}


def weights_digest(per_tensor: Mapping[str, str], leave_out: Iterable[str] = ()) -> str:
    """The weights part from ``tensor_digests``, without the entries named in ``leave_out``."""
    skip = set(leave_out)
    return digest(sorted((name, d) for name, d in per_tensor.items() if name not in skip))


BUFFER_PREFIX = "buffer:"
"""Parts named ``buffer:<name>``: a module buffer registered with ``persistent=False``, which no checkpoint
holds; the resumed run rebuilds it, and it must come out equal to what the saving run had."""


def fingerprint(
    model_state: Optional[Mapping[str, torch.Tensor]],
    optimizer_states: Optional[Iterable[Mapping[str, Any]]],
    rng: Any,
    data: Any,
    step: int,
    unsaved_buffers: Optional[Mapping[str, torch.Tensor]] = None,
    algorithm: str = HASH,
) -> dict[str, str]:
    """The fingerprint of one rank's training state, one digest per part (and per unsaved buffer).

    ``model_state=None`` / ``optimizer_states=None`` leave those parts out (see the module docstring)."""
    out = {"hash": algorithm} if algorithm != LEGACY_HASH else {}
    if model_state is not None and algorithm == LEGACY_HASH:
        out["weights"] = digest(model_state, algorithm)
    elif model_state is not None:
        out["weights"] = weights_digest(tensor_digests(model_state, algorithm))
    if optimizer_states is not None:
        out["optimizer"] = digest(list(optimizer_states), algorithm)
    out.update(rng=digest(rng, algorithm), data=digest(data, algorithm), step=str(int(step)))
    out.update({BUFFER_PREFIX + name: digest(buffer, algorithm) for name, buffer in (unsaved_buffers or {}).items()})
    return out


def algorithm_of(saved: Mapping[str, str]) -> str:
    """The hash a saved fingerprint was made with."""
    return saved.get("hash", LEGACY_HASH)


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
