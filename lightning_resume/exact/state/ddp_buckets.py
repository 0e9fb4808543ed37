"""DDP's gradient buckets laid out in a resumed process as the interrupted run had them.

DDP all-reduces gradients in buckets. It builds them in parameter order and, after the first backward that
all-reduces, rebuilds them once in the order the gradients became ready. A process that resumes starts
again from the first layout, so its first step reduces each gradient at another offset of another bucket.
A ring all-reduce adds the ranks' values of an element in an order set by the element's offset. With more
than two ranks that order changes the sum's last bits: (a + b) + c is not a + (b + c). Two ranks always
compute a + b, so they are immune.

``capture`` records the layout in each checkpoint (rebuilding a pending one first, as the next forward
would). ``restore`` builds the resumed process's reducer with that layout before its first step, so every
step reduces as in the uninterrupted run. Where it cannot (DDP's own mixed precision, a checkpoint without the layout), it names the cause. The private DDP names are in ``_compat.ddp``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional
from weakref import WeakKeyDictionary

import lightning.pytorch as pl
from torch.nn.parallel import DistributedDataParallel

from lightning_resume._compat import ddp as ddp_compat

KEY = "ddp_buckets"
"""The checkpoint entry: each bucket's parameter indices, in reduction order (``None``: DDP never rebuilt them)."""

_LAID_OUT: WeakKeyDictionary[DistributedDataParallel, list[list[int]]] = WeakKeyDictionary()
"""The layout ``restore`` gave a reducer, until the reducer rebuilds and records its own."""


def _ddp(trainer: pl.Trainer) -> Optional[DistributedDataParallel]:
    model = trainer.strategy.model
    return model if isinstance(model, DistributedDataParallel) and ddp_compat.reduces_in_buckets(model) else None


def capture(trainer: pl.Trainer) -> Optional[list[list[int]]]:
    """The layout of the buckets every later step reduces with (``None``: not DDP, or DDP never rebuilds).
    Every rank calls it at the same save: rebuilding a pending layout broadcasts rank 0's."""
    ddp = _ddp(trainer)
    if ddp is None:
        return None
    return ddp_compat.rebuilt_layout(ddp) or _LAID_OUT.get(ddp)


def restore(trainer: pl.Trainer, saved: Mapping[str, Any]) -> list[str]:
    """Lay the buckets out as ``saved`` records, before the first step; return what cannot be exact (one line
    naming the cause and the fix, or none)."""
    ddp = _ddp(trainer)
    if ddp is None or trainer.world_size <= 2:  # a + b == b + a: the layout cannot change a sum of two
        return []
    cause = _cause(ddp, saved)
    if cause is not None:
        return [
            f"the first step's gradient all-reduce over {trainer.world_size} ranks may differ in the last bits:"
            f" a new process starts DDP's gradient buckets in another layout than the interrupted run's, and {cause}"
        ]
    layout = saved[KEY]
    if layout is not None:
        ddp_compat.lay_out_buckets(ddp, layout)
        _LAID_OUT[ddp] = layout
    return []


def _cause(ddp: DistributedDataParallel, saved: Mapping[str, Any]) -> Optional[str]:
    """Why the saved layout cannot be given to this reducer, with the fix (``None``: it can)."""
    if saved.get(KEY, False) is None:
        return None  # the interrupted run never rebuilt its buckets: both start alike
    unsupported = ddp_compat.cannot_lay_out(ddp)
    if unsupported is not None:
        return f"{unsupported} cannot be built with the saved layout (fix: leave it out, or train on 2 ranks)"
    if KEY not in saved:
        return "this checkpoint does not record that layout (an earlier lightning-resume wrote it; new ones do)"
    layout, count = saved[KEY], ddp_compat.parameter_count(ddp)
    if layout is not None and not _fits(layout, count):
        return f"the checkpoint's layout {layout} does not hold each of this model's {count} parameters once"
    return None


def _fits(layout: Any, count: int) -> bool:
    """``layout`` is a list of buckets of indices that holds each of ``count`` parameters once."""
    if not isinstance(layout, list) or not all(isinstance(b, list) for b in layout):
        return False
    return sorted(i for bucket in layout for i in bucket) == list(range(count))
