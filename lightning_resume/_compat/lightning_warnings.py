"""Two warnings of Lightning's that contradict what lightning-resume does, each changed only where it is wrong.

- A resume that ended mid-epoch warns that the dataloader "is not resumable ... unreliable results"
  (loops/training_epoch_loop.py:219-229) when the loaders are not Lightning's ``_Stateful``, even though
  ``ExactResume`` has just restored their positions itself. :func:`quiet_unresumable_loader_warning`
  silences that one message during the next ``reset`` of one trainer's epoch loop, the call that raises it;
  the caller says so in a line of its own.
- ``fit(ckpt_path="last")`` with no checkpoint to resume warns "HINT: Set ``ModelCheckpoint(...,
  save_last=True)``" (trainer/connectors/checkpoint_connector.py:181-194) even when it is set, and although
  with a ``LastResolver`` among the callbacks "last" is not Lightning's ``last.ckpt`` at all: the resolver
  has already said what it searched and found (``retention.last``). :func:`quiet_last_hint_for_resolvers`
  takes the hint out of that message in the search, for fits where a resolver answers (the rule of
  ``_compat.lightning._find_last``), and nowhere else; the rest of it ("No checkpoint will be loaded"), which
  is true, is warned as Lightning warns it (Lightning's own tests expect it, and so may a user's).

Every other warning passes unchanged; the filters live only for the call they wrap (``catch_warnings``).
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Callable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.warnings import PossibleUserWarning

from lightning_resume.protocols import LastResolver

UNRESUMABLE_LOADER = "You're resuming from a checkpoint that ended before the epoch ended and your dataloader is"
"""The start of Lightning's warning at training_epoch_loop.py:224."""

NO_LAST_CHECKPOINT = r'\.fit\(ckpt_path="last"\) is set, but there is no last checkpoint available'
"""The start of Lightning's warning at checkpoint_connector.py:191 (a pattern: ``.fit`` is ``.{fn}``)."""

SAVE_LAST_HINT = " HINT: Set `ModelCheckpoint(..., save_last=True)`."
"""The end of that warning (checkpoint_connector.py:192), wrong where a ``LastResolver`` answers "last"."""


def quiet_unresumable_loader_warning(trainer: pl.Trainer) -> Callable[[], None]:
    """Silence Lightning's "dataloader is not resumable" warning during the next ``reset`` of ``trainer``'s
    training epoch loop (``_TrainingEpochLoop.run`` calls it first, training_epoch_loop.py:148-149), once.
    Returns the function that removes the hook if that call never came (an exception before it)."""
    loop = trainer.fit_loop.epoch_loop
    original = loop.reset

    def reset() -> None:
        remove()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=re.escape(UNRESUMABLE_LOADER), category=PossibleUserWarning)
            original()

    def remove() -> None:
        if loop.__dict__.get("reset") is reset:
            del loop.reset

    loop.reset = reset  # type: ignore[method-assign]
    return remove


_LIGHTNING_PARSE_CKPT_PATH = _CheckpointConnector._parse_ckpt_path


def _resolver_answers(trainer: pl.Trainer, state_fn: Any) -> bool:
    """Whether a ``LastResolver`` among the trainer's callbacks answers ``ckpt_path="last"`` (fit only): Lightning
    asks each ``ModelCheckpoint`` (checkpoint_connector.py:183-185), so there must be one to ask."""
    callbacks = getattr(trainer, "callbacks", [])  # assigned by Lightning's callback connector
    resolves = any(isinstance(cb, LastResolver) and cb.resolves_last for cb in callbacks)
    asked = any(isinstance(cb, ModelCheckpoint) for cb in trainer.checkpoint_callbacks)
    return resolves and asked and state_fn == TrainerFn.FITTING


def _parse_quietly(self: _CheckpointConnector, state_fn: Any, ckpt_path: Any, *args: Any, **kwargs: Any) -> Any:
    if ckpt_path != "last" or not _resolver_answers(self.trainer, state_fn):
        return _LIGHTNING_PARSE_CKPT_PATH(self, state_fn, ckpt_path, *args, **kwargs)
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            return _LIGHTNING_PARSE_CKPT_PATH(self, state_fn, ckpt_path, *args, **kwargs)
    finally:  # every warning of the search warned again as it was, once the filters are back, also on a raise
        for w in caught:
            warnings.warn_explicit(_without_hint(w.message), w.category, w.filename, w.lineno, source=w.source)


_parse_quietly.__name__ = "_parse_ckpt_path"  # a bound method pickles by its name


def _without_hint(message: Warning | str) -> Warning | str:
    """Lightning's no-last-checkpoint warning without its ``save_last`` hint; any other warning as it is."""
    text = str(message)
    if isinstance(message, Warning) and re.match(NO_LAST_CHECKPOINT, text) and text.endswith(SAVE_LAST_HINT):
        return type(message)(text[: -len(SAVE_LAST_HINT)])
    return message


def quiet_last_hint_for_resolvers() -> None:
    """Route ``_CheckpointConnector._parse_ckpt_path`` (checkpoint_connector.py:116) through a version that
    takes the ``save_last`` hint out when a ``LastResolver`` answered "last" (module docstring). Idempotent."""
    if _CheckpointConnector._parse_ckpt_path is _LIGHTNING_PARSE_CKPT_PATH:
        _CheckpointConnector._parse_ckpt_path = _parse_quietly  # type: ignore[method-assign]
