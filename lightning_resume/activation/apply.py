"""Apply a :class:`CheckpointPlan` to a module tree without renaming a single state-dict key.

Mechanism only: no Lightning, no decisions. A single-block unit gets its *instance* ``forward``
replaced by one that runs the class's forward under
``torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=True)``; a multi-block
unit (a ``sqrt`` segment) makes its parent ``nn.Sequential`` run that run of children under one
checkpoint. No wrapper module is inserted (unlike ``checkpoint_wrapper``, which adds
``_checkpoint_wrapped_module.`` to every name), so parameters, buffers, state-dict keys, optimizer
parameter order and ``named_modules()`` are the same with checkpointing on or off. Forward hooks
still run once per forward (outside the recomputed region). Without grad (validation, predict)
the original forward runs directly.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_resume.activation.policy import OWNER, CheckpointPlan
from lightning_resume.errors import ConfigurationError

_INNER = "_lightning_resume_ac_inner"  # an instance forward that was there before ours
_SEGMENTS = "_lightning_resume_ac_segments"  # {start: end} child ranges of an nn.Sequential
_MARK = "_lightning_resume_ac"  # set on every module whose forward we replaced


def _run_checkpointed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def _inner_forward(module: nn.Module) -> Callable[..., Any]:
    inner = module.__dict__.get(_INNER)
    return inner if inner is not None else types.MethodType(type(module).forward, module)


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return _run_checkpointed(_inner_forward(self), *args, **kwargs)


def _run_children(seq: nn.Sequential, start: int, end: int, x: Any) -> Any:
    for child in list(seq)[start:end]:
        x = child(x)
    return x


def _segmented_forward(self: nn.Sequential, x: Any) -> Any:
    segments: dict[int, int] = self.__dict__[_SEGMENTS]
    i, n = 0, len(self)
    while i < n:
        end = segments.get(i)
        if end is None:
            x, i = self[i](x), i + 1
        else:
            x, i = _run_checkpointed(_run_children, self, i, end, x), end
    return x


def _replace_forward(module: nn.Module, forward: Callable[..., Any]) -> None:
    if getattr(module, _MARK, False):
        raise ConfigurationError(
            OWNER, [f"{type(module).__name__} is already activation-checkpointed; apply a plan once"]
        )
    if "forward" in module.__dict__:
        object.__setattr__(module, _INNER, module.__dict__["forward"])
    # A bound method in the instance dict: deepcopy/pickle rebind it to the copy, keys stay untouched.
    object.__setattr__(module, "forward", types.MethodType(forward, module))
    object.__setattr__(module, _MARK, True)


def checkpoint_block(module: nn.Module) -> None:
    """Recompute ``module``'s forward in backward. Its names and state-dict keys do not change."""
    _replace_forward(module, _checkpointed_forward)


def checkpoint_segments(seq: nn.Sequential, ranges: Iterable[tuple[int, int]]) -> None:
    """Recompute each ``[start, end)`` run of ``seq``'s children as one unit (only its input is kept)."""
    segments = {start: end for start, end in ranges}
    if any(not 0 <= s < e <= len(seq) for s, e in segments.items()):
        raise ConfigurationError(OWNER, [f"segments {sorted(segments.items())} do not fit a Sequential of {len(seq)}"])
    _replace_forward(seq, _segmented_forward)
    object.__setattr__(seq, _SEGMENTS, segments)


def apply_plan(root: nn.Module, plan: CheckpointPlan) -> None:
    """Apply every unit of ``plan`` to ``root`` (names are qualified names inside ``root``)."""
    modules = dict(root.named_modules())
    missing = [name for name in plan.blocks if name not in modules]
    if missing:
        raise ConfigurationError(OWNER, [f"the plan names modules the model does not have: {missing[:5]}"])
    grouped: dict[str, list[tuple[int, int]]] = {}
    for unit in plan.units:
        if len(unit) == 1:
            checkpoint_block(modules[unit[0]])
            continue
        parent, run = _segment_range(root, modules, unit)
        grouped.setdefault(parent, []).append(run)
    for parent, ranges in grouped.items():
        checkpoint_segments(modules[parent], ranges)


def _segment_range(root: nn.Module, modules: dict[str, nn.Module], unit: Sequence[str]) -> tuple[str, tuple[int, int]]:
    parents = {name.rpartition(".")[0] for name in unit}
    parent = parents.pop() if len(parents) == 1 else None
    seq = modules.get(parent) if parent is not None else None
    if parent is None or not isinstance(seq, nn.Sequential):
        raise ConfigurationError(OWNER, [f"segment {list(unit)} must be consecutive children of one nn.Sequential"])
    keys = [name for name, _ in seq.named_children()]
    positions = [keys.index(name.rpartition(".")[2]) for name in unit]
    if positions != list(range(positions[0], positions[0] + len(unit))):
        raise ConfigurationError(OWNER, [f"segment {list(unit)} is not a run of consecutive children of {parent!r}"])
    return parent, (positions[0], positions[-1] + 1)


def remove_activation_checkpointing(root: nn.Module) -> int:
    """Undo :func:`apply_plan` on every module of ``root``; returns how many were restored."""
    restored = 0
    for module in root.modules():
        if module.__dict__.pop(_MARK, False):
            del module.__dict__["forward"]
            module.__dict__.pop(_SEGMENTS, None)
            inner = module.__dict__.pop(_INNER, None)
            if inner is not None:
                object.__setattr__(module, "forward", inner)
            restored += 1
    return restored
