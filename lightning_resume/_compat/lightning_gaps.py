"""The Lightning 2.6 internals behind the resume gaps ``exact.lightning_gaps`` compensates.

Lightning skips ``ReduceLROnPlateau`` steps while it restarts, forgets which file a ``ModelCheckpoint`` saved
last, and a ``CombinedLoader(mode="max_size")`` restarts an exhausted loader. Each private name used for them is
here, one small function each, with the file:line of lightning 2.6.6 it relies on (as in ``_compat.lightning``).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities import CombinedLoader


def plateau_configs(trainer: pl.Trainer, interval: str) -> list[Any]:
    """The ``ReduceLROnPlateau`` configs Lightning steps at ``interval`` (training_epoch_loop.py:474-476)."""
    if not trainer.lightning_module.automatic_optimization:
        return []
    return [c for c in trainer.lr_scheduler_configs if c.reduce_on_plateau and c.interval == interval]


def step_plateau_schedulers(trainer: pl.Trainer, interval: str, index: int) -> None:
    """Step the plateau schedulers of ``interval`` as ``_update_learning_rates`` does after batch (or epoch)
    ``index`` (training_epoch_loop.py:462-517): frequency, monitored value, progress counters, the module's
    ``lr_scheduler_step`` hook. A monitor not logged is skipped (a strict one raised in the saving run)."""
    loop = trainer.fit_loop.epoch_loop
    for config in plateau_configs(trainer, interval):
        if (index + 1) % config.frequency != 0:
            continue
        value = loop._get_monitor_value(config.monitor)
        if value is None:
            continue
        loop.scheduler_progress.increment_ready()
        call._call_lightning_module_hook(trainer, "lr_scheduler_step", config.scheduler, value)
        loop.scheduler_progress.increment_completed()


def step_epoch_plateau_of(trainer: pl.Trainer, epoch: int) -> None:
    """The epoch-interval plateau step of finished epoch ``epoch``, which Lightning already counts completed:
    ``current_epoch`` reads ``epoch`` while the module's hook runs (trainer.py:1562-1564)."""
    progress = trainer.fit_loop.epoch_progress.current
    progress.completed, counted = epoch, progress.completed
    try:
        step_plateau_schedulers(trainer, "epoch", epoch)
    finally:
        progress.completed = counted


def batch_index(trainer: pl.Trainer) -> int:
    """The index in its epoch of the batch trained last (training_epoch_loop.py:140-143)."""
    return int(trainer.fit_loop.epoch_loop.batch_idx)


def end_restart_before_epoch_plateau(trainer: pl.Trainer) -> None:
    """Let the fit loop step the plateau schedulers at the end of a resumed epoch. It skips them while it is
    restarting (fit_loop.py:488-491), which lasts the whole first epoch of a resume (it ends in
    ``on_iteration_done``, loop.py:109-110, right after); nothing else reads the flag between the epoch-end
    hooks and that step. Past FitLoop's setter, which keeps iteration-based loops restarting (fit_loop.py:139)."""
    fit_loop = trainer.fit_loop
    if fit_loop.restarting:
        fit_loop._restarting = False


# ------------------------------------------------------------------------------ ModelCheckpoint


def _saving_frame_path(callback: ModelCheckpoint) -> Optional[str]:
    """The file ``callback`` is writing now (``_save_checkpoint(trainer, filepath)``, model_checkpoint.py:593)."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "_save_checkpoint" and frame.f_locals.get("self") is callback:
            return str(frame.f_locals.get("filepath"))
        frame = frame.f_back
    return None


def last_saved_files(trainer: pl.Trainer) -> dict[str, dict[str, Any]]:
    """Each ``ModelCheckpoint``'s runtime save state that its ``state_dict`` leaves out, as it is once the save
    being written completes: the file it saved last (``_last_checkpoint_saved``, model_checkpoint.py:299, :602:
    ``on_train_end`` writes ``last`` again when it is empty, :535-540; ``save_last="link"`` links to it, :920) and
    a step save deferred to the next validation (``_defer_save_until_validation``, :451, :506-511)."""
    out = {}
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint):
            writing = _saving_frame_path(cb)
            out[cb.state_key] = {
                "dirpath": None if cb.dirpath is None else str(cb.dirpath),
                "last_saved": writing if writing is not None else str(cb._last_checkpoint_saved),
                "deferred": bool(getattr(cb, "_defer_save_until_validation", False)),
            }
    return out


def restore_last_saved_files(trainer: pl.Trainer, saved: Mapping[str, Any]) -> None:
    """Put back what :func:`last_saved_files` recorded, for each callback whose directory is the same (Lightning's
    own rule for its state, model_checkpoint.py:556-571)."""
    for cb in trainer.checkpoint_callbacks:
        if not isinstance(cb, ModelCheckpoint):
            continue
        state = saved.get(cb.state_key)
        if not isinstance(state, Mapping) or state.get("dirpath") != (None if cb.dirpath is None else str(cb.dirpath)):
            continue
        cb._last_checkpoint_saved = str(state.get("last_saved") or "")
        if hasattr(cb, "_defer_save_until_validation"):
            cb._defer_save_until_validation = bool(state.get("deferred"))


# ------------------------------------------------------------------------------ CombinedLoader


def combined_mode(trainer: pl.Trainer) -> Optional[str]:
    """The mode of the training ``CombinedLoader`` Lightning iterates (fit_loop.py:239-251)."""
    combined = trainer.fit_loop._combined_loader
    return None if combined is None else str(combined._mode)


def restart_with_exhausted(trainer: pl.Trainer, exhausted: set[int], restart: Callable[[], None]) -> None:
    """Run ``restart`` (which makes the training iterator) with the loaders numbered ``exhausted`` seen as empty
    by the ``CombinedLoader``'s new mode iterator (combined_loader.py:348-353, :184-199), so that they stay
    exhausted for the rest of the epoch and keep their loaded position for the next one. The iterator gets the
    real loaders back for its length (combined_loader.py:201-205) and the next epoch's ``iter``."""
    combined: Optional[CombinedLoader] = trainer.fit_loop._combined_loader
    if combined is None or not exhausted:
        restart()
        return
    loaders = combined.flattened
    combined.flattened = [[] if i in exhausted else dl for i, dl in enumerate(loaders)]
    try:
        restart()
    finally:
        combined.flattened = loaders
        if combined._iterator is not None:
            combined._iterator.iterables = loaders
