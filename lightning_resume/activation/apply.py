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

A checkpointed call runs its forward twice with the same arguments, so per-call state among them (a
Hugging Face key/value cache, which appends on every call) is switched off for that call, with one info
line per block class, or the call is refused where that is not safe: the rule is in :mod:`.call_state`.

Selective units (``plan.selective``) run under the same checkpoint with a ``context_fn`` from
``torch.utils.checkpoint.create_selective_checkpoint_contexts``: a policy that answers
``MUST_SAVE`` for the ops named in ``plan.save_ops`` and ``PREFER_RECOMPUTE`` for every other op.
Forward caches the saved ops' outputs; backward reruns the region, taking those outputs from the
cache and recomputing the rest, with the RNG state restored as for full recomputation (dropout draws
the same mask). Random ops are refused in the save list: a cached random op would not advance the
generator during the rerun, so every later random op would draw different numbers.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence

import torch
from torch import nn
from torch._ops import OpOverload
from torch.fx.operator_schemas import get_signature_for_torch_op
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_resume.activation.call_state import CallStateSwitch
from lightning_resume.activation.policy import DEFAULT_SAVE_OPS, OWNER, CheckpointPlan
from lightning_resume.errors import ConfigurationError

_INNER = "_lightning_resume_ac_inner"  # an instance forward that was there before ours
_SEGMENTS = "_lightning_resume_ac_segments"  # {start: end} child ranges of an nn.Sequential
_MARK = "_lightning_resume_ac"  # set on every module whose forward we replaced
_SAVE_OPS = "_lightning_resume_ac_save_ops"  # op names a selective block keeps (strings: deepcopy-safe)
_SWITCH = "_lightning_resume_ac_call_state"  # the CallStateSwitch of a checkpointed block (one per plan)


def _resolve_one(name: str) -> list[OpOverload]:
    namespace, op, *overload = name.split(".")
    packet = getattr(getattr(torch.ops, namespace), op)  # AttributeError when absent
    if overload:
        return [getattr(packet, overload[0])]
    return [getattr(packet, o) for o in packet.overloads()]


class SaveOps(NamedTuple):
    """Resolved ``save_ops``: every op overload whose output is kept, and those among them that are
    random only when their ``dropout_p`` argument is not 0 (fused attention): kept only when it is 0."""

    ops: frozenset[OpOverload]
    with_dropout: frozenset[OpOverload]


@functools.lru_cache(maxsize=64)
def resolve_save_ops(names: tuple[str, ...]) -> SaveOps:
    """Op names (``"aten.mm"``: every overload; ``"aten.mm.default"``: one) -> :class:`SaveOps`.

    Names from :data:`DEFAULT_SAVE_OPS` that this torch build lacks are skipped; any other unknown
    name, and any op that is always random (it would draw different numbers when the rest is rerun),
    is refused.
    """
    ops: set[OpOverload] = set()
    problems = []
    for name in names:
        try:
            resolved = _resolve_one(name)
        except (AttributeError, RuntimeError, ValueError):
            if name not in DEFAULT_SAVE_OPS:
                problems.append(
                    f"save_ops: {name!r} is not an op of this torch build; use names like 'aten.mm' or 'aten.mm.default'"
                )
            continue
        if any(_is_random(op) and not _takes_dropout(op) for op in resolved):
            problems.append(
                f"save_ops: {name!r} is a random op; keeping its output would change later random draws in the rerun:"
                " leave it out"
            )
        ops.update(resolved)
    if problems:
        raise ConfigurationError(OWNER, problems)
    return SaveOps(frozenset(ops), frozenset(op for op in ops if _is_random(op)))


def _is_random(op: OpOverload) -> bool:
    return torch.Tag.nondeterministic_seeded in op.tags


@functools.lru_cache(maxsize=256)
def _signature(op: OpOverload) -> Optional[inspect.Signature]:
    signatures = get_signature_for_torch_op(op) or []
    return signatures[0] if len(signatures) == 1 else None


def _takes_dropout(op: OpOverload) -> bool:
    signature = _signature(op)
    return signature is not None and "dropout_p" in signature.parameters


def _dropout_p(op: OpOverload, args: tuple, kwargs: dict) -> float:
    signature = _signature(op)
    if signature is None or "dropout_p" not in signature.parameters:
        return 0.0
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return float(bound.arguments["dropout_p"])


def keeps_output(save: SaveOps, op: Any, args: tuple, kwargs: dict) -> bool:
    """Whether selective recomputation keeps this op call's output (fused attention: only without dropout)."""
    return op in save.ops and not (op in save.with_dropout and _dropout_p(op, args, kwargs) != 0.0)


def _save_policy(save: SaveOps) -> Callable[..., CheckpointPolicy]:
    def policy(_ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if keeps_output(save, op, args, kwargs) else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _run_checkpointed(fn: Callable[..., Any], *args: Any, save_ops: tuple[str, ...] = (), **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if save_ops:
        context_fn = functools.partial(create_selective_checkpoint_contexts, _save_policy(resolve_save_ops(save_ops)))
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context_fn, **kwargs)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def _inner_forward(module: nn.Module) -> Callable[..., Any]:
    inner = module.__dict__.get(_INNER)
    return inner if inner is not None else types.MethodType(type(module).forward, module)


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    fn = _inner_forward(self)
    if torch.is_grad_enabled():  # only then is the call checkpointed, and rerun in backward
        args, kwargs = self.__dict__[_SWITCH](self, fn, args, kwargs)
    return _run_checkpointed(fn, *args, save_ops=self.__dict__.get(_SAVE_OPS, ()), **kwargs)


def _run_children(seq: nn.Sequential, start: int, end: int, x: Any) -> Any:
    for child in list(seq)[start:end]:
        x = child(x)
    return x


def _segmented_forward(self: nn.Sequential, x: Any) -> Any:
    segments: dict[int, tuple[int, tuple[str, ...]]] = self.__dict__[_SEGMENTS]
    i, n = 0, len(self)
    while i < n:
        segment = segments.get(i)
        if segment is None:
            x, i = self[i](x), i + 1
        else:
            end, save_ops = segment
            x, i = _run_checkpointed(_run_children, self, i, end, x, save_ops=save_ops), end
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


def checkpoint_block(
    module: nn.Module, save_ops: Sequence[str] = (), call_state: Optional[CallStateSwitch] = None
) -> None:
    """Recompute ``module``'s forward in backward. Its names and state-dict keys do not change.

    ``save_ops``: op names whose outputs are kept (selective recomputation); empty: recompute all.
    ``call_state``: switches per-call state (caches) off in checkpointed calls; shared to log once per class.
    """
    if save_ops:
        resolve_save_ops(tuple(save_ops))  # refuse bad names now, not in the first training step
    _replace_forward(module, _checkpointed_forward)
    object.__setattr__(module, _SWITCH, call_state or CallStateSwitch())
    if save_ops:
        object.__setattr__(module, _SAVE_OPS, tuple(save_ops))


def checkpoint_segments(
    seq: nn.Sequential, ranges: Iterable[tuple[int, int]], save_ops: Optional[dict[int, tuple[str, ...]]] = None
) -> None:
    """Recompute each ``[start, end)`` run of ``seq``'s children as one unit (only its input is kept).

    ``save_ops``: for a run starting at ``start``, the op names whose outputs it keeps (selective).
    """
    segments = {start: (end, tuple((save_ops or {}).get(start, ()))) for start, end in ranges}
    if any(not 0 <= s < e <= len(seq) for s, (e, _) in segments.items()):
        bounds = sorted((s, e) for s, (e, _) in segments.items())
        raise ConfigurationError(OWNER, [f"segments {bounds} do not fit a Sequential of {len(seq)}"])
    for _, ops in segments.values():
        if ops:
            resolve_save_ops(ops)
    _replace_forward(seq, _segmented_forward)
    object.__setattr__(seq, _SEGMENTS, segments)


def apply_plan(root: nn.Module, plan: CheckpointPlan, log: Optional[Callable[[str], None]] = None) -> None:
    """Apply every unit of ``plan`` to ``root`` (names are qualified names inside ``root``).

    ``log``: where the one line per block class whose cache is switched off goes (default: this package's logger).
    """
    modules = dict(root.named_modules())
    missing = [name for name in plan.blocks if name not in modules]
    if missing:
        raise ConfigurationError(OWNER, [f"the plan names modules the model does not have: {missing[:5]}"])
    grouped: dict[str, list[tuple[int, int]]] = {}
    kept: dict[str, dict[int, tuple[str, ...]]] = {}
    units = [(unit, ()) for unit in plan.units] + [(unit, plan.save_ops) for unit in plan.selective]
    call_state = CallStateSwitch(log)
    for unit, save_ops in units:
        if len(unit) == 1:
            checkpoint_block(modules[unit[0]], save_ops, call_state)
            continue
        parent, run = _segment_range(root, modules, unit)
        grouped.setdefault(parent, []).append(run)
        kept.setdefault(parent, {})[run[0]] = tuple(save_ops)
    for parent, ranges in grouped.items():
        checkpoint_segments(modules[parent], ranges, kept.get(parent))


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
            module.__dict__.pop(_SAVE_OPS, None)
            module.__dict__.pop(_SWITCH, None)
            inner = module.__dict__.pop(_INNER, None)
            if inner is not None:
                object.__setattr__(module, "forward", inner)
            restored += 1
    return restored
