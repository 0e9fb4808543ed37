"""Measure the activation bytes a forward pass keeps for backward, per block.

Mechanism only: no Lightning, no decisions. It runs a caller-given forward under
``torch.autograd.graph.saved_tensors_hooks`` and counts every *storage* saved for backward once
(views of one storage share it), leaving out parameters and buffers (they are not activations).
Each storage is charged to every watched block running when it was first saved (a block's bytes
include its children's). Exact and
deterministic on CPU for a given input; it reads no allocator statistics.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

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


def _cost_fields(name: str, costs: Optional[RecomputeCosts]) -> dict[str, Any]:
    if costs is None:
        return {}
    if name == "":
        return {"forward_seconds": costs.total_seconds}
    return {
        "forward_seconds": costs.forward_seconds.get(name),
        "selective_seconds": costs.selective_seconds.get(name),
        "selective_bytes": costs.selective_bytes.get(name),
    }


def block_records(
    root: nn.Module, saved: Optional[SavedBytes] = None, costs: Optional[RecomputeCosts] = None
) -> list[BlockRecord]:
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
                **_cost_fields(name, costs),
            )
        )
    return records


@dataclass(frozen=True)
class RecomputeCosts:
    """What recomputation costs per watched block, from timed forward passes.

    ``forward_seconds``: time of the block's ops (children included): the cost of recomputing it
    whole. ``selective_seconds``: time of the ops selective recomputation reruns (all but the saved
    ops). ``selective_bytes``: unique bytes of the saved ops' outputs (what selective recomputation
    keeps), its own inputs, parameters and buffers excluded. ``total_seconds``: the whole forward.
    """

    total_seconds: float
    forward_seconds: dict[str, float]
    selective_seconds: dict[str, float]
    selective_bytes: dict[str, int]


class _OpClock(TorchDispatchMode):
    """Times every aten op and charges it to the watched blocks running; keeps saved ops' outputs."""

    def __init__(self, meter: _Meter, keep: Callable[..., bool], sync: Callable[[], None]) -> None:
        super().__init__()
        self.meter, self.keep, self.sync = meter, keep, sync
        self.seconds: dict[str, float] = defaultdict(float)
        self.rerun: dict[str, float] = defaultdict(float)
        self.total = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        start = time.perf_counter()
        out = func(*args, **kwargs)
        self.sync()
        seconds = time.perf_counter() - start
        self.total += seconds
        kept = self.keep(func, args, kwargs)
        for name in self.meter.stack:
            self.seconds[name] += seconds
            if not kept:
                self.rerun[name] += seconds
        if kept:
            for t in _tensors(tree_leaves(out)):
                self.meter.pack(t)
        return out


def measure_recompute(
    root: nn.Module,
    forward: Callable[[], Any],
    blocks: Iterable[str],
    keep: Callable[[Any, tuple, dict], bool],
    repeats: int = 3,
) -> RecomputeCosts:
    """Time ``forward()`` op by op (grad enabled; best of ``repeats`` per block, after one warm-up).

    ``keep(op, args, kwargs)``: whether selective recomputation keeps that op's output (the same
    decision its checkpoint policy makes). Times are wall-clock on the calling thread; on CUDA each
    op is followed by a synchronize, which inflates small ops alike in every block.
    """
    blocks = list(blocks)
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else (lambda: None)
    runs = [_timed_pass(root, forward, blocks, keep, sync) for _ in range(repeats + 1)][1:]
    best = min(runs, key=lambda r: r.total_seconds)
    return RecomputeCosts(
        total_seconds=best.total_seconds,
        forward_seconds={n: min(r.forward_seconds[n] for r in runs) for n in blocks},
        selective_seconds={n: min(r.selective_seconds[n] for r in runs) for n in blocks},
        selective_bytes=best.selective_bytes,
    )


def _timed_pass(
    root: nn.Module, forward: Callable[[], Any], blocks: list[str], keep: Callable[..., bool], sync: Callable[[], None]
) -> RecomputeCosts:
    modules = dict(root.named_modules())
    meter = _Meter(root)
    clock = _OpClock(meter, keep, sync)
    with ExitStack() as stack:
        for name in blocks:
            pre = modules[name].register_forward_pre_hook(meter.pre_hook(name), with_kwargs=True)
            post = modules[name].register_forward_hook(meter.post_hook, with_kwargs=True, always_call=True)
            stack.callback(pre.remove)
            stack.callback(post.remove)
        stack.enter_context(torch.enable_grad())
        stack.enter_context(clock)
        output = forward()
    kept = meter.result(blocks, ()).per_block
    del output
    return RecomputeCosts(clock.total, {n: clock.seconds[n] for n in blocks}, {n: clock.rerun[n] for n in blocks}, kept)


def measure_kept_bytes(forward: Callable[[], Any], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the storages ``forward()`` creates that are still alive when it returns.

    What a training step holds for backward at the end of forward, however it is held: autograd's
    saved tensors, inputs kept by checkpoints, outputs cached by selective checkpointing. The
    returned output's own storages, storages that existed before (inputs, parameters, buffers) and
    ``exclude`` are left out. Counts every op below autograd with a dispatch mode.
    """
    census = _Census()
    with census, torch.enable_grad():
        output = forward()
    gone = {StorageWeakRef(t.untyped_storage()).cdata for t in [*_tensors(tree_leaves(output)), *exclude]}
    total = census.alive_bytes(gone)
    del output
    return total


class _Census(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.created: dict[int, tuple[StorageWeakRef, int]] = {}
        self.external: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        for t in _tensors(tree_leaves((args, kwargs))):
            if t.layout == torch.strided and (ref := StorageWeakRef(t.untyped_storage())).cdata not in self.created:
                self.external.add(ref.cdata)
        out = func(*args, **kwargs)
        for t in _tensors(tree_leaves(out)):
            if t.layout == torch.strided:
                ref = StorageWeakRef(t.untyped_storage())
                seen = self.created.get(ref.cdata)
                # A freed storage's address can come back for a new one: the new one counts.
                if ref.cdata not in self.external and (seen is None or seen[0].expired()):
                    self.created[ref.cdata] = (ref, t.untyped_storage().nbytes())
        return out

    def alive_bytes(self, exclude: set[int]) -> int:
        return sum(size for key, (ref, size) in self.created.items() if key not in exclude and not ref.expired())
