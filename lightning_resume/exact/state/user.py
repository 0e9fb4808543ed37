"""State users keep outside Lightning's lists: found by a bounded walk, captured per rank, restored by path.

Training changes more than Lightning saves: an LR scheduler the module keeps and steps itself, torchmetrics
metrics (their states are not in the module's ``state_dict``), objects with the ``state_dict()`` /
``load_state_dict()`` protocol (torchdata's ``Stateful``), and random generators held by plain objects (a
gym-style ``env.np_random``). ``find`` walks the objects given to it (the module, the datamodule, the train
datasets) and what they hold: attributes of modules and of plain objects, and lists, tuples and dicts of
them, a few levels deep, each object once; never into a Trainer, an optimizer, a loader or sampler, a
callback, or tensors. What Lightning already saves is left out (its optimizers and schedulers, modules whose
state is in the module's ``state_dict``, the datamodule's own ``state_dict``); the train datasets' state
travels with their loaders. Objects registered by name (``ExactResume(state=...)``) are held under
``state.<name>``. Every captured value is plain (tensors, numbers, strings, lists, tuples and dicts; NumPy
arrays are converted), so it loads with ``torch.load(weights_only=True)`` and encodes without pickle. What
cannot be captured is named once, with the fix. Mechanisms only: knows neither Lightning's loops nor files.
"""

from __future__ import annotations

import collections
import functools
import random
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_resume._compat import torchmetrics as tm
from lightning_resume.exact.state.fingerprint import digest

MAX_DEPTH = 4
"""Attribute, submodule and container hops from a root (each level of submodules is one hop): deep enough for
``model.env.np_random``, ``model.head.metrics`` or ``datamodule.train_set.buffer``, shallow enough to stay
cheap. A generator deeper in the module tree is not held; ``state.limits`` names it at train start."""

MAX_ITEMS = 64
"""Containers with more items are not walked (a replay buffer's transitions, a dataset's samples)."""

GENERATORS: dict[type, str] = {
    torch.Generator: "torch.Generator",
    np.random.Generator: "numpy.random.Generator",
    np.random.RandomState: "numpy.random.RandomState",
    random.Random: "random.Random",
}
"""Random streams an object may hold, by the name a report gives them."""

SCHEDULER = "LR scheduler"
METRIC = "torchmetrics metric"
STATEFUL = "state_dict()/load_state_dict()"

_PLAIN_LEAVES = (bool, int, float, str, type(None))
_NUMPY = "@numpy"
_DEVICE = "@device"


class NotPlain(TypeError):
    """A value no checkpoint stores without pickle: ``where`` names it inside the captured state."""

    def __init__(self, where: str, kind: str) -> None:
        super().__init__(f"{where or 'the state'} is a {kind}")
        self.where, self.kind = where, kind


@dataclass(frozen=True)
class Held:
    """One object whose state is saved: where it was found, what it is (``kind``)."""

    path: str
    obj: Any
    kind: str


@dataclass
class UserState:
    """What a fit saves beyond Lightning: the objects held, and one line per object that cannot be saved."""

    held: list[Held] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)
    """``(path, line)`` of each object found whose state cannot be saved."""

    @property
    def unsaved(self) -> list[str]:
        """One line per object found whose state cannot be saved (``refused``)."""
        return [line for _, line in self.refused]

    @property
    def paths(self) -> list[str]:
        return [h.path for h in self.held]


# ------------------------------------------------------------------------------------------ the walk


def find(
    roots: Mapping[str, Any],
    registered: Mapping[str, Any],
    lightning_saves: Iterable[Any],
    walk_only: Iterable[Any] = (),
) -> UserState:
    """Every object reachable from ``roots`` whose state training changes and no checkpoint holds, and the
    objects ``registered`` by name (held as ``state.<name>``); each checked once by capturing it.

    ``lightning_saves``: objects Lightning's checkpoint already holds (its schedulers), never held. Modules are walked, never held (their state is the module's ``state_dict``), but metrics.
    ``walk_only``: objects whose state travels otherwise (the train datasets), walked but not held."""
    found = UserState()
    skip = {id(x) for x in lightning_saves} | {id(x) for x in registered.values()}
    walker = _Walker(skip, {id(x) for x in walk_only} | {id(r) for r in roots.values()})
    candidates = [Held(f"state.{name}", obj, _kind(obj) or STATEFUL) for name, obj in registered.items()]
    for name, root in roots.items():
        candidates += walker.walk(name, root, 0)
    for held in candidates:
        problem = _capture_problem(held)
        if problem is None:
            found.held.append(held)
        else:
            found.refused.append((held.path, problem))
    return found


def find_in_fit(trainer: Any, roots: Mapping[str, Any], registered: Mapping[str, Any]) -> UserState:
    """``find`` for a fit: Lightning's own schedulers (``trainer.lr_scheduler_configs``) are left out."""
    return find(roots, registered, [config.scheduler for config in trainer.lr_scheduler_configs])


def _kind(value: Any) -> Optional[str]:
    """What ``value`` is, if its state is saved: a generator type, a metric, a scheduler, a ``Stateful``."""
    generator = next((name for cls, name in GENERATORS.items() if isinstance(value, cls)), None)
    if generator is not None:
        return generator
    if tm.is_metric(value):
        return METRIC
    if isinstance(value, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        return SCHEDULER
    if _has_state_protocol(type(value)):
        return STATEFUL
    return None


def _has_state_protocol(cls: type) -> bool:
    """Whether ``cls`` defines ``state_dict`` and ``load_state_dict``. Asked of the class, not the object: an
    object that makes attributes up on request (a ``unittest.mock.Mock``, a proxy's ``__getattr__``) has no
    state of its own, and calling them would act on it (a mock records the call)."""
    return callable(getattr(cls, "state_dict", None)) and callable(getattr(cls, "load_state_dict", None))


NEVER_WALKED = (
    torch.Tensor,
    np.ndarray,
    torch.optim.Optimizer,
    DataLoader,
    Sampler,
    type,
    types.ModuleType,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    functools.partial,
    str,
    bytes,
    bytearray,
    memoryview,
)
"""What the walk never enters or holds: tensors and arrays, optimizers (Lightning saves them), loaders and
samplers (``ExactResume`` saves their positions), classes, Python modules, functions and text."""


def _lightning_owned(value: Any) -> bool:
    """A Trainer, a callback, a strategy, a logger, a ``LightningOptimizer``, a ``CombinedLoader``: Lightning's
    own objects, which its checkpoint or ``ExactResume``'s other parts hold."""
    module = type(value).__module__ or ""
    return module.startswith(("lightning.", "pytorch_lightning.", "lightning_fabric.", "lightning_resume."))


class _Walker:
    def __init__(self, skip: set[int], walk_only: set[int]) -> None:
        self.seen: set[int] = set()
        self.skip, self.walk_only = skip, walk_only

    def walk(self, path: str, obj: Any, depth: int) -> Iterator[Held]:
        if obj is None or isinstance(obj, _PLAIN_LEAVES) or id(obj) in self.seen or depth > MAX_DEPTH:
            return
        self.seen.add(id(obj))
        if id(obj) in self.skip or isinstance(obj, NEVER_WALKED):
            return
        kind = _kind(obj)
        if id(obj) not in self.walk_only and kind is not None and not _saved_elsewhere(obj, kind):
            yield Held(path, obj, kind)
            return  # its state_dict is its whole state
        if _lightning_owned(obj) and id(obj) not in self.walk_only or kind == STATEFUL and isinstance(obj, Dataset):
            return  # a Stateful dataset's state_dict is its state (a train loader saves it)
        yield from self._children(path, obj, depth)

    def _children(self, path: str, obj: Any, depth: int) -> Iterator[Held]:
        if isinstance(obj, nn.Module):
            for name, child in obj.named_children():
                yield from self.walk(f"{path}.{name}", child, depth + 1)
        if isinstance(obj, (list, tuple, collections.deque)) and len(obj) <= MAX_ITEMS:
            for i, item in enumerate(obj):
                yield from self.walk(f"{path}[{i}]", item, depth + 1)
        elif isinstance(obj, Mapping) and len(obj) <= MAX_ITEMS:
            for key, item in list(obj.items()):
                yield from self.walk(f"{path}[{key!r}]", item, depth + 1)
        for name, value in _attributes(obj):
            yield from self.walk(f"{path}.{name}", value, depth + 1)


def _attributes(obj: Any) -> list[tuple[str, Any]]:
    """An object's own attributes; for a module, those that are not its parameters, buffers or submodules
    (walked as children) nor ``nn.Module``'s bookkeeping."""
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict):
        return []
    if isinstance(obj, nn.Module):
        return [(k, v) for k, v in attrs.items() if k not in _MODULE_INTERNALS]
    return list(attrs.items())


_MODULE_INTERNALS = frozenset(vars(nn.Module()))
"""``nn.Module``'s own fields (parameters, buffers, submodules, hooks): never user state."""


def _saved_elsewhere(obj: Any, kind: str) -> bool:
    """Objects with the protocol whose state a checkpoint already holds another way (datasets: their loaders)."""
    return kind == STATEFUL and (isinstance(obj, Dataset) or isinstance(obj, nn.Module) and not tm.is_metric(obj))


# ------------------------------------------------------------------------------- capture and restore


def capture(user: Optional[UserState], reset: Iterable[Any] = ()) -> dict[str, Any]:
    """``{path: {"kind", "state"}}`` of every held object, plain values copied now; a metric in ``reset``
    (Lightning resets it before its next update) is saved as reset (``"reset": True``)."""
    resets = {id(m) for m in reset}
    out: dict[str, Any] = {}
    for held in user.held if user is not None else []:
        if id(held.obj) in resets:
            out[held.path] = {"kind": held.kind, "reset": True}
        else:
            out[held.path] = {"kind": held.kind, "state": _state_of(held.obj, held.kind)}
    return out


def restore_user_state(user: Optional[UserState], saved: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """Put each held object back to its saved state; return the paths restored and one line per object held
    now and not in the checkpoint, or in it and not found now."""
    held = user.held if user is not None else []
    restored, missing = [], []
    for h in held:
        entry = saved.get(h.path)
        if entry is None or entry.get("kind") != h.kind:
            missing.append(f"{h.path} ({h.kind}) is not in the checkpoint: it starts from its state in this run")
            continue
        if entry.get("reset"):
            h.obj.reset()
        else:
            _set_state(h.obj, h.kind, entry["state"])
        restored.append(h.path)
    here = {h.path for h in held}
    missing += [f"{path} ({e.get('kind')}) is in the checkpoint but not found in this run" for path, e in
                saved.items() if path not in here]  # fmt: skip
    return restored, missing


RESET_BY_TRAIN_START = (METRIC, SCHEDULER)
"""Kinds a module's ``on_train_start`` may reset (lightning-hydra-template resets its validation metrics there,
against the sanity check), which Lightning calls again on every resumed fit, after ``ExactResume``'s restore."""


def put_back_later(user: Optional[UserState]) -> Optional[Callable[[], None]]:
    """What puts the metrics and schedulers back as they are now (restored, a due validation run), undoing
    what later ``on_train_start`` hooks did to them: the uninterrupted run ran none between the two steps.
    ``None`` when nothing is held of those kinds."""
    again = UserState(held=[h for h in (user.held if user is not None else []) if h.kind in RESET_BY_TRAIN_START])
    if not again.held:
        return None
    now = capture(again)

    def put_back() -> None:
        restore_user_state(again, now)

    return put_back


def user_state_digests(captured: Mapping[str, Any]) -> dict[str, str]:
    """``{path: digest}`` of a ``capture``: what a trace compares, object by object, between two runs."""
    return {path: digest(entry) for path, entry in captured.items()}


def _state_of(obj: Any, kind: str) -> Any:
    if kind == "torch.Generator":
        return obj.get_state().clone()
    if kind == "numpy.random.Generator":
        return to_plain(obj.bit_generator.state)
    if kind == "numpy.random.RandomState":
        return to_plain(obj.get_state(legacy=False))
    if kind == "random.Random":
        version, internal, gauss_next = obj.getstate()
        return {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next}
    if kind == METRIC:
        return {"states": to_plain(obj.metric_state), "update_count": int(obj.update_count)}
    return to_plain(obj.state_dict())


def _set_state(obj: Any, kind: str, state: Any) -> None:
    if kind == "torch.Generator":
        obj.set_state(state)
    elif kind == "numpy.random.Generator":
        obj.bit_generator.state = from_plain(state)
    elif kind == "numpy.random.RandomState":
        obj.set_state(from_plain(state))
    elif kind == "random.Random":
        obj.setstate((state["version"], tuple(int(x) for x in state["state"].tolist()), state["gauss_next"]))
    elif kind == METRIC:
        _set_metric(obj, state)
    else:
        obj.load_state_dict(from_plain(state))


def _set_metric(metric: Any, state: Mapping[str, Any]) -> None:
    device = metric.device
    for name, value in from_plain(state["states"]).items():
        moved = [v.to(device) for v in value] if isinstance(value, list) else value.to(device)
        setattr(metric, name, moved)
    tm.set_update_count(metric, state["update_count"])
    tm.invalidate_cache(metric)


def _capture_problem(held: Held) -> Optional[str]:
    """Why ``held`` cannot be saved, with the fix; ``None`` when a capture of it is plain."""
    try:
        _state_of(held.obj, held.kind)
    except NotPlain as err:
        inside = f" at {err.where}" if err.where else ""
        return (
            f"{held.path} ({type(held.obj).__name__}): its state_dict() holds a {err.kind}{inside}, which no"
            " checkpoint stores without pickle; return tensors, numbers, strings, lists and dicts from state_dict()"
        )
    except Exception as err:  # noqa: BLE001 (a user's state_dict() that fails is named, not fatal to training)
        return f"{held.path} ({type(held.obj).__name__}): state_dict() raised {type(err).__name__}: {err}"
    return None


# ------------------------------------------------------------------------------------- plain values


def to_plain(value: Any, where: str = "") -> Any:
    """A copy of ``value`` made of tensors (on the CPU), numbers, strings, ``None``, lists, tuples and dicts;
    NumPy arrays and scalars become tagged dicts of their bytes (``from_plain`` makes them again), a tensor
    off the CPU a tagged dict naming its device. Anything else raises ``NotPlain``."""
    if isinstance(value, _PLAIN_LEAVES):
        return value
    if isinstance(value, torch.Tensor):
        copy = value.detach().to("cpu", copy=True)
        return copy if value.device.type == "cpu" else {_DEVICE: str(value.device), "tensor": copy}
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.ascontiguousarray(value)
        data = torch.tensor(bytearray(array.tobytes()), dtype=torch.uint8)
        return {_NUMPY: array.dtype.str, "shape": list(array.shape), "scalar": isinstance(value, np.generic),
                "bytes": data}  # fmt: skip
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise NotPlain(f"{where}[{key!r}]", f"key of type {type(key).__name__}")
            out[key] = to_plain(item, f"{where}[{key!r}]")
        return collections.OrderedDict(out) if isinstance(value, collections.OrderedDict) else out
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        items = [to_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    raise NotPlain(where, type(value).__qualname__)


def from_plain(value: Any) -> Any:
    """The inverse of ``to_plain``: NumPy arrays and scalars, and tensors on their devices, made again."""
    if isinstance(value, Mapping):
        if _NUMPY in value:
            raw = bytes(value["bytes"].numpy().tobytes())
            array = np.frombuffer(raw, dtype=np.dtype(value[_NUMPY])).reshape(value["shape"]).copy()
            return array[()] if value["scalar"] else array
        if _DEVICE in value:
            device = torch.device(value[_DEVICE])
            usable = device.type != "cuda" or torch.cuda.is_available()
            return value["tensor"].to(device) if usable else value["tensor"]
        items = {key: from_plain(item) for key, item in value.items()}
        return collections.OrderedDict(items) if isinstance(value, collections.OrderedDict) else items
    if isinstance(value, list):
        return [from_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(from_plain(item) for item in value)
    return value


# -------------------------------------------------------------------------------------- registration


def registration_problems(state: Optional[Mapping[str, Any]]) -> list[str]:
    """What is wrong with ``ExactResume(state=...)``: one line per entry, naming it and the fix."""
    if state is None:
        return []
    if not isinstance(state, Mapping):
        return [f"state={type(state).__name__} must be a dict of name -> object"]
    problems = []
    for name, obj in state.items():
        if not isinstance(name, str) or not name:
            problems.append(f"state key {name!r} must be a non-empty string naming the object")
        elif _kind(obj) is None:
            problems.append(
                f"state[{name!r}] is a {type(obj).__name__}, which has no state to save: pass an object with"
                " state_dict() and load_state_dict(), or a torch.Generator, numpy.random.Generator,"
                " numpy.random.RandomState or random.Random"
            )
        elif isinstance(obj, torch.optim.Optimizer) or _lightning_owned(obj):
            problems.append(f"state[{name!r}] ({type(obj).__name__}) is saved by Lightning already: leave it out")
    return problems


def metrics_held(user: Optional[UserState]) -> list[Any]:
    """The metrics among the held objects (a capture saves as reset those Lightning is about to reset)."""
    return [h.obj for h in (user.held if user is not None else []) if h.kind == METRIC]
