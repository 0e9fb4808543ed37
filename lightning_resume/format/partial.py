"""Which live modules a failed load left part-overwritten, and the refusal to train on them.

A load that reads a checkpoint's weights straight into the module (``format.in_place``) may fail after some of
them were written: a checksum, a type the tree names that this process does not know, a remote read cut
mid-body. The module then holds part of the file and part of itself. ``format.in_place.overwritten_error``
words the error; :func:`mark` remembers the module (weakly, in this process) with that error, and
:func:`refusal` turns a fit on it into the same error, until a load into it succeeds (:func:`forget`) or the
user keeps it as it is (:func:`accept_partial`). This module knows modules and errors, not files or Lightning.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Optional, Tuple

from lightning_resume.errors import PartialLoadError

if TYPE_CHECKING:  # pragma: no cover
    import torch

_LEFT: weakref.WeakKeyDictionary[torch.nn.Module, Tuple[str, str, int]] = weakref.WeakKeyDictionary()
"""Each module a failed in-place load left part-overwritten -> (path, the refusal's message, tensors overwritten)."""


def mark(module: torch.nn.Module, path: str, message: str, overwritten: int) -> None:
    """Remember that a load of ``path`` failed after writing ``overwritten`` of ``module``'s tensors."""
    _LEFT[module] = (
        path,
        f"refusing to train {type(module).__name__}: an earlier load in this process failed after it had"
        f" overwritten {overwritten} of its tensors in place, so it holds part of {path} and part of its own"
        f" weights. The load said: {message}",
        overwritten,
    )


def forget(module: torch.nn.Module) -> None:
    """A load into ``module`` succeeded: its weights are the file's, whole."""
    _LEFT.pop(module, None)


def accept_partial(module: torch.nn.Module) -> None:
    """Train on ``module`` as an earlier failed load left it (part the file's weights, part its own): the fit that
    would refuse it no longer does. Building the module again, or loading a checkpoint that verifies into it,
    does the same without keeping the mixed weights."""
    forget(module)


def refusal(module: Optional[torch.nn.Module], resumed: bool) -> Optional[PartialLoadError]:
    """The error a fit on ``module`` must raise, or ``None``. ``resumed``: the fit restored a checkpoint into the
    module before it started (that restore replaced every weight, so the mark is dropped)."""
    if module is None or module not in _LEFT:
        return None
    if resumed:
        forget(module)
        return None
    return PartialLoadError(*_LEFT[module])


def refuse_partly_loaded(trainer: Any) -> None:
    """At fit start: raise ``PartialLoadError`` if the trainer's module is one an earlier load in this process
    left part-overwritten and this fit restored nothing into it."""
    refused = refusal(getattr(trainer, "lightning_module", None), resumed=bool(trainer.ckpt_path))
    if refused is not None:
        raise refused
