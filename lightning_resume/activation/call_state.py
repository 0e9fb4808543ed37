"""Per-call state of a checkpointed block (key/value caches): found in the call's arguments and switched off.

Mechanism only: no Lightning, no ``transformers`` import (it is not a dependency). A recomputed block runs
its forward twice, once in forward and once more in backward, with the same arguments. An argument the
forward *updates* is then updated twice: a Hugging Face ``Cache`` appends this step's keys and values on
every call, so the rerun attends over twice the sequence (a shape error in backward, or gradients of a
different computation). Hugging Face's own gradient checkpointing (``GradientCheckpointingLayer`` in
``transformers/modeling_layers.py``) switches the cache off for checkpointed layers in training; this
module applies the same rule to any block, found by structure:

- *per-call state* is a value that behaves like HF's ``Cache`` (callable ``update`` and ``get_seq_length``),
  under any name or position, or any value other than ``None``, a tensor, a plain scalar or a tuple of them
  (legacy ``(key, value)`` pairs are only read, so reading them twice is safe) passed as ``cache``,
  ``past_key_values``, ``past_key_value`` or ``layer_past``;
- it is switched off, for the checkpointed call only, where that is what the block itself means by "no
  cache": a parameter whose default is ``None`` gets ``None``; a keyword the forward only collects in
  ``**kwargs`` is left out; ``use_cache=True`` becomes ``False`` (as HF does);
- anywhere else (positional without a ``None`` default, in ``*args``, a required parameter) switching off
  is not known to be safe, and the call is refused with a :class:`ConfigurationError` naming the option
  to change, in forward, before anything runs twice.

A block class that sets ``_can_checkpoint_with_cache = True`` (HF's mark for a layer that only reads the
cache, so the rerun reads the same states) keeps its cache; ``use_cache`` still becomes ``False``.

Only calls that are actually checkpointed (gradients enabled) change: validation and generation keep the
cache. The model's returned cache stays empty in a training step, as under HF's gradient checkpointing.
Without its cache a model may compute differently in the last bits (GPT-2's attention runs on strided
views instead of the cache's contiguous copies), so a run with checkpointing is bitwise equal to one
without when both set ``use_cache=False``.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable, Optional

import torch

from lightning_resume.activation.policy import OWNER
from lightning_resume.errors import ConfigurationError

CACHE_NAMES = frozenset({"cache", "past_key_values", "past_key_value", "layer_past"})
"""Argument names that hold a key/value cache in Hugging Face layers (``cache`` since transformers 5)."""
USE_CACHE = "use_cache"
READS_ONLY = "_can_checkpoint_with_cache"
"""Class attribute by which a Hugging Face layer declares that it only reads its cache (then it keeps it)."""

_log = logging.getLogger(__name__)
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def is_cache(value: Any) -> bool:
    """Whether ``value`` behaves like Hugging Face's ``Cache``: it appends in ``update`` and knows its length."""
    return callable(getattr(value, "update", None)) and callable(getattr(value, "get_seq_length", None))


def _read_only(value: Any) -> bool:
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, str)):
        return True
    return isinstance(value, tuple) and all(_read_only(v) for v in value)


def is_call_state(name: Optional[str], value: Any) -> bool:
    """Whether argument ``name`` (``None``: unnamed) with ``value`` is state the forward would update twice."""
    return is_cache(value) or (name in CACHE_NAMES and not _read_only(value))


class CallStateSwitch:
    """Switches per-call state off in checkpointed calls; says so once per block class (one per plan)."""

    def __init__(self, log: Optional[Callable[[str], None]] = None) -> None:
        self.log = log or _log.info
        self.noted: set[str] = set()

    def __call__(
        self, module: torch.nn.Module, fn: Callable[..., Any], args: tuple, kwargs: dict
    ) -> tuple[tuple, dict]:
        """``args``/``kwargs`` for the checkpointed call of ``fn`` (``module``'s forward), state switched off."""
        name = type(module).__name__
        keep = getattr(type(module), READS_ONLY, False) is True
        args, kwargs, changed = switch_off(name, fn, args, kwargs, keep_state=keep)
        if changed and name not in self.noted:
            self.noted.add(name)
            self.log(
                f"activation checkpointing: {name} is recomputed in backward, so in training it runs with"
                f" {', '.join(changed)} (the rerun would update its cache a second time; Hugging Face's gradient"
                " checkpointing does the same): a training step returns no cache, and a run compares bit for bit"
                " with one without checkpointing when both set use_cache=False"
            )
        return args, kwargs


@functools.lru_cache(maxsize=256)
def _parameters(fn: Callable[..., Any]) -> Optional[tuple[inspect.Parameter, ...]]:
    try:
        return tuple(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or a callable without a signature: nothing is known
        return None


def _signature_of(fn: Callable[..., Any]) -> Optional[tuple[inspect.Parameter, ...]]:
    func = getattr(fn, "__func__", None)  # a bound method: cache per function, drop ``self``
    try:
        params = _parameters(func if func is not None else fn)
    except TypeError:  # unhashable: not cached
        params = _parameters.__wrapped__(func if func is not None else fn)
    if func is not None and params and params[0].kind in _POSITIONAL:
        return params[1:]
    return params


def switch_off(
    block: str, fn: Callable[..., Any], args: tuple, kwargs: dict, keep_state: bool = False
) -> tuple[tuple, dict, list[str]]:
    """``(args, kwargs, what was changed)`` for calling ``fn`` (of class ``block``) with its per-call state off.

    ``keep_state``: the block only reads its state; only ``use_cache`` is switched off.

    Raises :class:`ConfigurationError` where the state cannot be switched off by the block's own default.
    """
    params = _signature_of(fn) or ()
    named = {p.name: p for p in params if p.kind in (*_POSITIONAL, inspect.Parameter.KEYWORD_ONLY)}
    positional = [p for p in params if p.kind in _POSITIONAL]
    new_args, new_kwargs, changed, problems = list(args), dict(kwargs), [], []
    for i, value in enumerate(args):
        param = positional[i] if i < len(positional) else None
        new = _switched(param.name if param else None, value, param, in_kwargs=False, keep_state=keep_state)
        if new is _REFUSE:
            problems.append(_refusal(block, param.name if param else None, value))
        elif new is not _KEEP:
            new_args[i] = new
            changed.append(f"{param.name if param else i}={new}")
    for key, value in kwargs.items():
        new = _switched(key, value, named.get(key), in_kwargs=True, keep_state=keep_state)
        if new is _REFUSE:
            problems.append(_refusal(block, key, value))
        elif new is _DROP:
            del new_kwargs[key]
            changed.append(f"{key}=None")
        elif new is not _KEEP:
            new_kwargs[key] = new
            changed.append(f"{key}={new}")
    if problems:
        raise ConfigurationError(OWNER, problems)
    return tuple(new_args), new_kwargs, changed


_KEEP, _DROP, _REFUSE = object(), object(), object()


def _switched(
    name: Optional[str], value: Any, param: Optional[inspect.Parameter], in_kwargs: bool, keep_state: bool
) -> Any:
    """What an argument becomes in the checkpointed call: ``_KEEP``, ``_DROP`` (left out), ``_REFUSE`` or a value."""
    if name == USE_CACHE and value is True:
        return False
    if keep_state or not is_call_state(name, value):
        return _KEEP
    if param is not None and param.default is None:
        return None
    if param is None and in_kwargs:  # only collected in **kwargs: not passing it is the forward's own default
        return _DROP
    return _REFUSE


def _refusal(block: str, name: Optional[str], value: Any) -> str:
    shown = f"{name}=" if name else "a positional argument "
    return (
        f"{block} is checkpointed and called with {shown}{type(value).__name__}, state its forward updates, so the"
        " recompute in backward would update it a second time; it cannot be switched off here (no None default):"
        " set use_cache=False on the model (e.g. `model.config.use_cache = False`) or leave this block out of"
        " blocks/pattern"
    )
