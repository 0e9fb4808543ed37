"""The ``on_train_epoch_start`` hooks Lightning skips when it restarts inside an epoch.

Lightning calls no epoch-start hook on a mid-epoch restart, yet some callbacks build state there that no
checkpoint holds: ``StochasticWeightAveraging`` installs its LR scheduler (without it the LR runs an
epoch late), ``GradientAccumulationScheduler`` sets the epoch's accumulation. Those are replayed, once,
before the RNG and data position are restored (whatever randomness they draw is then put back), and the
state the checkpoint does hold (weights, buffers, optimizer hyperparameters such as the LR) is put back
after them, so a replay only adds what the checkpoint lacks. Any other hook is not called twice (it may
count, draw or log again); a warning names it. After a save on an epoch's last batch the skipped hooks
are the next epoch's, which never ran: all of them run, at the point the uninterrupted run called them.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import (
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
    ProgressBar,
    StochasticWeightAveraging,
)
from lightning.pytorch.utilities import rank_zero_warn

from lightning_resume._compat import lightning as lc
from lightning_resume.errors import ExactResumeWarning

REPLAYED = (StochasticWeightAveraging, GradientAccumulationScheduler)
"""Callbacks whose epoch-start hook only rebuilds, from restored state, what the checkpoint does not hold."""

ALREADY_DONE = (ProgressBar, LearningRateMonitor, ModelCheckpoint)
"""Callbacks whose epoch hooks only display, log or save, which the saving run already did."""

NO_OP_AT_EPOCH_END = (StochasticWeightAveraging,)
"""Callbacks whose ``on_train_epoch_end`` changes nothing in a fresh process."""


def replay_epoch_start(trainer: pl.Trainer) -> list[str]:
    """On a restart inside an epoch, replay the epoch-start hooks in ``REPLAYED``; return the names of the
    other hooks that changed the saving run's state at that epoch's start and are not re-run."""
    if not lc.restarted_inside_epoch(trainer):
        return []
    hooked = [h for h in lc.hook_overriders(trainer, "on_train_epoch_start") if not isinstance(h, ALREADY_DONE)]
    replayed = [h for h in hooked if isinstance(h, REPLAYED)]
    if replayed:
        kept = _checkpointed_state(trainer)
        for h in replayed:
            lc.call_epoch_start(trainer, h)
        _put_back(trainer, kept)
    return [f"{type(h).__name__}.on_train_epoch_start" for h in hooked if not isinstance(h, REPLAYED)]


def warn_not_replayed(names: list[str]) -> None:
    """One warning naming the epoch hooks that ran in the saving run and do not run again on this resume."""
    if names:
        rank_zero_warn(
            "ExactResume: Lightning does not call these epoch hooks on this resume and they are not re-run:"
            f" {', '.join(names)}. If one sets state that the checkpoint does not hold, the resumed run will"
            " differ from an uninterrupted one; keep that state in the callback's state_dict.",
            category=ExactResumeWarning,
        )


def start_skipped_epoch(trainer: pl.Trainer) -> list[str]:
    """After a save on an epoch's last batch, run the next epoch's start (hooks and counters), which
    Lightning skips; return the names of the saved epoch's ``on_train_epoch_end`` hooks it skipped too."""
    if not lc.next_epoch_start_skipped(trainer):
        return []
    lc.start_next_epoch(trainer)
    skipped = lc.hook_overriders(trainer, "on_train_epoch_end")
    return [
        f"{type(h).__name__}.on_train_epoch_end"
        for h in skipped
        if not isinstance(h, ALREADY_DONE + NO_OP_AT_EPOCH_END) and not _ours(h)
    ]


def _ours(hooked: Any) -> bool:
    """lightning-resume's own callbacks: their epoch hooks only reset per-epoch bookkeeping the resume sets."""
    return type(hooked).__module__.split(".")[0] == "lightning_resume"


def _checkpointed_state(trainer: pl.Trainer) -> tuple[dict[str, Any], list[list[dict[str, Any]]]]:
    module = {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}
    hyper = [
        [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
        for opt in trainer.optimizers
    ]
    return module, hyper


def _put_back(trainer: pl.Trainer, kept: tuple[dict[str, Any], list[list[dict[str, Any]]]]) -> None:
    module, hyper = kept
    trainer.lightning_module.load_state_dict(module)
    for opt, groups in zip(trainer.optimizers, hyper, strict=True):
        for group, values in zip(opt.param_groups, groups, strict=False):
            group.update(values)
