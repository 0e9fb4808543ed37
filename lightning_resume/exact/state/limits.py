"""What no checkpoint can make exact, found before training so the user hears of it once.

Random generators that ``ExactResume`` does not save (a ``torch.Generator``, ``numpy.random.Generator``
or ``random.Random`` kept on the model, the datamodule or a dataset where the walk of ``state.user`` does not
reach, and not registered with ``state=``), nondeterministic CUDA kernels, and a wall-clock ``max_time`` (the run then stops at
a step that depends on machine speed). Each finding is one line naming the object and the fix. Walks
objects given to it; knows neither Lightning's loops nor files.
"""

from __future__ import annotations

import random
from typing import Any, Iterable, Iterator, Mapping, Optional

import numpy as np
import torch
from torch import nn

RANDOM_TYPES = {
    torch.Generator: "torch.Generator",
    np.random.Generator: "numpy.random.Generator",
    np.random.RandomState: "numpy.random.RandomState",
    random.Random: "random.Random",
}
"""Objects holding a random stream of their own (the global streams are saved by ``ExactResume``)."""


def _random_type(value: Any) -> Optional[str]:
    return next((name for cls, name in RANDOM_TYPES.items() if isinstance(value, cls)), None)


def unsaved_generator_paths(roots: Mapping[str, Any], registered: Iterable[torch.Generator]) -> list[tuple[str, str]]:
    """``(object path, line)`` of each random generator reachable from ``roots`` (attributes of the objects, of
    their submodules, and of the datasets they wrap) that is not among ``registered`` (the path is the finding's
    subject)."""
    saved = {id(g) for g in registered}
    found = []
    for path, value in _attributes(roots):
        if id(value) in saved:
            continue
        fix = "register it by name with ExactResume(state={...})"
        found.append((path, f"{path} is a {_random_type(value)} no checkpoint saves; {fix}"))
    return found


def _attributes(roots: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    seen: set[int] = set()
    for name, root in roots.items():
        yield from _walk(name, root, seen, depth=0)


def _walk(path: str, obj: Any, seen: set[int], depth: int) -> Iterator[tuple[str, Any]]:
    if obj is None or id(obj) in seen or depth > 3:
        return
    seen.add(id(obj))
    if isinstance(obj, nn.Module):
        for name, module in obj.named_modules():
            prefix = f"{path}.{name}" if name else path
            for attr, value in vars(module).items():
                if _random_type(value):
                    yield f"{prefix}.{attr}", value
        return
    for attr, value in getattr(obj, "__dict__", {}).items():
        if _random_type(value):
            yield f"{path}.{attr}", value
        elif attr == "dataset" or attr.endswith("_dataset"):  # wrappers (Subset, ResumableDataset, ...)
            yield from _walk(f"{path}.{attr}", value, seen, depth + 1)


def nondeterministic_kernels(device: torch.device) -> Optional[str]:
    """Why bitwise equality cannot hold on ``device``, or ``None``: CUDA kernels with atomics (scatter,
    some convolutions' backward, index_add) sum in a different order from run to run."""
    if device.type != "cuda" or torch.are_deterministic_algorithms_enabled():
        return None
    return (
        "CUDA kernels are not in deterministic mode, so results can differ in the last bits between any two runs"
        " (resumed or not); use Trainer(deterministic=True) for bitwise equality"
    )


def wall_clock_stop(has_timer: bool) -> Optional[str]:
    """Why the run's last step cannot be the uninterrupted run's, or ``None``."""
    if not has_timer:
        return None
    return (
        "max_time (a Timer callback) stops training by wall clock: the resumed run stops at another step than an"
        " uninterrupted one would (every step up to there is exact); use max_steps or max_epochs to end at the"
        " same step"
    )
