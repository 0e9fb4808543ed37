"""Measure the activation bytes a forward pass keeps for backward, per block.

Mechanism only: no Lightning, no decisions. It runs a caller-given forward under
``torch.autograd.graph.saved_tensors_hooks`` and counts every *storage* saved for backward once
(views of one storage share it), leaving out parameters and buffers (they are not activations).
Each storage is charged to every watched block running when it was first saved (a block's bytes
include its children's). Exact and
deterministic on CPU for a given input; it reads no allocator statistics.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from lightning_resume.activation.policy import BlockRecord


@dataclass(frozen=True)
class SavedBytes:
    """``total``: unique saved bytes of the forward (plus the inputs of ``keep_inputs_of`` modules).
    ``per_block``: bytes saved while each watched block ran (children included), its own inputs excluded.
    ``input_bytes``: bytes of each watched block's inputs that something saved."""

    total: int
    per_block: dict[str, int]
    input_bytes: dict[str, int]


def _storage_key(t: torch.Tensor) -> Optional[tuple[int, int]]:
    if t.layout != torch.strided or t.device.type == "meta":
        return None
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    return [v for v in values if isinstance(v, torch.Tensor)]


class _Meter:
    def __init__(self, root: nn.Module) -> None:
        self.excluded = {k[0] for t in [*root.parameters(), *root.buffers()] if (k := _storage_key(t))}
        self.saved: dict[int, tuple[int, tuple[str, ...]]] = {}  # ptr -> (bytes, blocks running)
        self.inputs: dict[str, dict[int, int]] = {}
        self.stack: list[str] = []
        self.alive: list[torch.Tensor] = []  # keep inputs alive so no address is reused mid-pass

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key is not None and key[0] not in self.excluded and key[0] not in self.saved:
            self.saved[key[0]] = (key[1], tuple(self.stack))
            self.alive.append(t)
        return t

    def pre_hook(self, name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            tensors = _tensors([*args, *kwargs.values()])
            self.alive.extend(tensors)
            self.inputs.setdefault(name, {}).update(k for t in tensors if (k := _storage_key(t)))
            self.stack.append(name)

        return hook

    def post_hook(self, _module: nn.Module, _args: tuple, _kwargs: dict, _out: Any) -> None:
        self.stack.pop()

    def result(self, blocks: Iterable[str], keep_inputs_of: Iterable[str]) -> SavedBytes:
        kept = {p: b for p, (b, _) in self.saved.items()}
        for name in keep_inputs_of:
            kept.update(self.inputs.get(name, {}))
        per_block, input_bytes = {}, {}
        for name in blocks:
            own = self.inputs.get(name, {})
            per_block[name] = sum(b for p, (b, o) in self.saved.items() if name in o and p not in own)
            input_bytes[name] = sum(b for p, b in own.items() if p in self.saved)
        return SavedBytes(sum(kept.values()), per_block, input_bytes)


def measure_saved_bytes(
    root: nn.Module, forward: Callable[[], Any], blocks: Iterable[str] = (), keep_inputs_of: Iterable[str] = ()
) -> SavedBytes:
    """Run ``forward()`` once with grad enabled and count what it saves for backward.

    ``blocks``: qualified names (in ``root``) to charge bytes to. ``keep_inputs_of``: modules whose
    inputs are kept alive by other means (the heads of activation-checkpointed units: checkpoint
    holds their inputs outside autograd's saved tensors), added to ``total``.
    """
    blocks, keep_inputs_of = list(blocks), list(keep_inputs_of)
    modules = dict(root.named_modules())
    meter = _Meter(root)
    with ExitStack() as stack:
        for name in dict.fromkeys([*blocks, *keep_inputs_of]):
            pre = modules[name].register_forward_pre_hook(meter.pre_hook(name), with_kwargs=True)
            post = modules[name].register_forward_hook(meter.post_hook, with_kwargs=True, always_call=True)
            stack.callback(pre.remove)
            stack.callback(post.remove)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t))
        stack.enter_context(torch.enable_grad())
        output = forward()  # held until counted: nothing saved is freed and its address reused
    result = meter.result(blocks, keep_inputs_of)
    del output
    return result


def class_paths(module: nn.Module) -> tuple[str, ...]:
    """Import paths of the module's class and its bases (so a class matches its subclasses)."""
    return tuple(f"{c.__module__}.{c.__qualname__}" for c in type(module).__mro__ if issubclass(c, nn.Module))


def block_records(root: nn.Module, saved: Optional[SavedBytes] = None) -> list[BlockRecord]:
    """One :class:`BlockRecord` per module of ``root`` (the root itself has name ``""``)."""
    records = []
    for name, module in root.named_modules():
        parent_name, _, key = name.rpartition(".")
        parent = root.get_submodule(parent_name) if name else None
        records.append(
            BlockRecord(
                name=name,
                class_paths=class_paths(module),
                container=parent_name,
                sequential=isinstance(parent, nn.Sequential),
                position=[n for n, _ in parent.named_children()].index(key) if parent is not None else 0,
                params=sum(p.numel() for p in module.parameters()),
                saved_bytes=saved.per_block.get(name) if saved else None,
                input_bytes=saved.input_bytes.get(name) if saved else None,
            )
        )
    return records
