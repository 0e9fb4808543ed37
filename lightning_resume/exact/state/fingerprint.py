"""A small fingerprint of training state: one digest per part (weights, optimizer, RNG, data, step).

Saved with every checkpoint and recomputed after restore, so a resume that did not restore what was
saved is caught at once instead of showing up as a drifting loss curve. The weights and optimizer parts,
the bulk of the bytes, may be left out at save (``fingerprint(model_state=None)``): a checkpoint format
that records and verifies every tensor's own digest (``SafetensorsCheckpointIO``) already proves the file
holds what was saved, and the restored state is then compared with the loaded checkpoint instead
(``tensor_digests``), once per resume rather than on the training thread at every save. Digests are
xxh3-128 (near memory speed on one core, as the file checksums), named in the fingerprint's ``hash``
part; a fingerprint that names another hash is reported as a mismatch, never compared digest by digest.
Pure hashing over values; no Lightning, no files.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import torch
import xxhash

HASH = "xxh3-128"
"""The digest of fingerprints (recorded in them as ``hash``)."""


def _feed(h: xxhash.xxh3_128, obj: Any) -> None:
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
    h = xxhash.xxh3_128()
    _feed(h, obj)
    return h.hexdigest()


def tensor_digests(state: Mapping[str, Any]) -> dict[str, str]:
    """One digest per entry of a model state dict: a loaded checkpoint's and the restored module's compare
    entry by entry, leaving out the ones a rank holds on purpose differently (``rank_local``)."""
    return {str(name): digest(value) for name, value in state.items()}


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
) -> dict[str, str]:
    """The fingerprint of one rank's training state, one digest per part (and per unsaved buffer).

    ``model_state=None`` / ``optimizer_states=None`` leave those parts out (see the module docstring)."""
    out = {"hash": HASH}
    if model_state is not None:
        out["weights"] = weights_digest(tensor_digests(model_state))
    if optimizer_states is not None:
        out["optimizer"] = digest(list(optimizer_states))
    out.update(rng=digest(rng), data=digest(data), step=str(int(step)))
    out.update({BUFFER_PREFIX + name: digest(buffer) for name, buffer in (unsaved_buffers or {}).items()})
    return out


def fingerprint_mismatches(saved: Mapping[str, str], restored: Mapping[str, str], parts: Iterable[str]) -> list[str]:
    """Lines naming each part whose restored digest differs from the saved one; one line instead when the
    saved fingerprint was not made with ``HASH`` (its digests cannot be compared)."""
    if saved.get("hash") != HASH:
        return [f"hash: the checkpoint's fingerprint names {saved.get('hash')!r}, this version makes {HASH!r}"]
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
