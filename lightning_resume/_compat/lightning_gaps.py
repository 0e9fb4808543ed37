"""The Lightning 2.6 internals behind the resume gaps ``exact.lightning_gaps`` compensates.

Lightning skips ``ReduceLROnPlateau`` steps while it restarts, forgets which file a ``ModelCheckpoint`` saved
last, a ``CombinedLoader(mode="max_size")`` restarts an exhausted loader, the values ``self.log`` accumulated in
an epoch are in no checkpoint, and the end of an epoch saved at its last batch is skipped. Each private name used for them is
here, one small function each, with the file:line of lightning 2.6.6 it relies on (as in ``_compat.lightning``).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultMetric, _Sync
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.combined_loader import _MaxSizeCycle


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


def step_epoch_plateau(trainer: pl.Trainer, epoch: int) -> None:
    """The epoch-interval plateau step of epoch ``epoch`` (``current_epoch`` must read it: :func:`reading_epoch`)."""
    step_plateau_schedulers(trainer, "epoch", epoch)


@contextmanager
def reading_epoch(trainer: pl.Trainer, epoch: int) -> Iterator[None]:
    """``trainer.current_epoch`` reads ``epoch`` inside (it is ``epoch_progress.current.completed``,
    trainer.py:1562-1564): the hooks and logged rows of finished epoch ``epoch``, which Lightning already counts
    completed."""
    progress = trainer.fit_loop.epoch_progress.current
    progress.completed, counted = epoch, progress.completed
    try:
        yield
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


def finishes_saved_epoch(trainer: pl.Trainer) -> bool:
    """Whether Lightning finishes the saved epoch itself on this resume: a save after the epoch's last batch and
    before its end hooks (at the end of the validation that batch ran) restarts the fit loop mid-epoch
    (fit_loop.py:354-360) and the epoch loop on its last batch (training_epoch_loop.py:175-182). Its first advance
    skips that validation (:281-289), then the fit loop runs the epoch's end hooks (fit_loop.py:471-500) and starts
    the next epoch, its hooks and its iterator, as the uninterrupted run did (fit_loop.py:447-454,
    training_epoch_loop.py:245-246)."""
    fit_loop = trainer.fit_loop
    return bool(fit_loop.restarted_mid_epoch and fit_loop.epoch_loop.restarted_on_last)


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


def cycle_consumed(trainer: pl.Trainer) -> Optional[list[bool]]:
    """Which loaders of a ``CombinedLoader(mode="max_size_cycle")`` ran out in this epoch and were cycled
    (``_MaxSizeCycle._consumed``, combined_loader.py:70, :80); ``None`` in another mode. The epoch ends when the
    last of them runs out (:81-82), which counts for loaders without a length (an ``IterableDataset``)."""
    combined = trainer.fit_loop._combined_loader
    iterator = None if combined is None else combined._iterator
    return list(iterator._consumed) if isinstance(iterator, _MaxSizeCycle) else None


def set_cycle_consumed(trainer: pl.Trainer, consumed: list[bool]) -> None:
    """Put back what :func:`cycle_consumed` recorded into the restarted mode iterator, which starts them all unread
    (combined_loader.py:91-94)."""
    combined = trainer.fit_loop._combined_loader
    iterator = None if combined is None else combined._iterator
    if isinstance(iterator, _MaxSizeCycle) and len(iterator._consumed) == len(consumed):
        iterator._consumed = [bool(flag) for flag in consumed]


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


# ------------------------------------------------------------------------------ logged results

_REDUCTIONS: dict[str, Callable[..., Any]] = {
    "torch.mean": torch.mean, "torch.max": torch.max, "torch.min": torch.min, "torch.sum": torch.sum,
    "max": max, "min": min, "sum": sum,
}  # fmt: skip
"""The reductions ``self.log(reduce_fx=...)`` accepts (result.py:126-143, :161-181), by a name a checkpoint holds."""


def _reduction_name(reduce_fx: Callable[..., Any]) -> Optional[str]:
    return next((name for name, fx in _REDUCTIONS.items() if fx is reduce_fx), None)


def logged_results(trainer: pl.Trainer) -> dict[str, dict[str, Any]]:
    """What ``self.log`` has accumulated in the training epoch so far (``training_epoch_loop._results``,
    training_epoch_loop.py:92), which no checkpoint holds: per key, the ``_ResultMetric``'s arguments
    (``_Metadata``, result.py:106-122; its ``_Sync``, :50-56) and its state, as tensors and plain values. A logged
    torchmetrics ``Metric`` keeps its own state (its module attribute); only Lightning's entry for it is here."""
    out: dict[str, dict[str, Any]] = {}
    for key, metric in trainer.fit_loop.epoch_loop._results.items():
        meta, sync = metric.meta, metric.meta.sync
        if metric.has_reset:  # reset at the last epoch end and not logged since (result.py:261, :455-457)
            continue
        record = {
            "fx": meta.fx, "name": meta.name, "prog_bar": meta.prog_bar, "logger": meta.logger,
            "on_step": meta.on_step, "on_epoch": meta.on_epoch, "reduce_fx": _reduction_name(meta.reduce_fx),
            "enable_graph": meta.enable_graph, "add_dataloader_idx": meta.add_dataloader_idx,
            "dataloader_idx": meta.dataloader_idx, "metric_attribute": meta.metric_attribute,
            "sync_dist": sync.should, "rank_zero_only": sync.rank_zero_only, "sync_group": sync.group is not None,
            "is_tensor": metric.is_tensor, "updates": int(metric._update_count),
        }  # fmt: skip
        if metric.is_tensor:  # the states add_state made (result.py:199-202)
            record["value"] = metric.value.detach().cpu().clone()
            if meta.is_mean_reduction:
                record["cumulated_batch_size"] = metric.cumulated_batch_size.detach().cpu().clone()
        if isinstance(metric._forward_cache, torch.Tensor):  # the last on_step value (result.py:225, :243)
            record["forward_cache"] = metric._forward_cache.detach().cpu().clone()
        out[str(key)] = record
    return out


def restore_logged_results(trainer: pl.Trainer, saved: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Put the entries :func:`logged_results` recorded back into the training ``_ResultCollection``, each with the
    arguments ``LightningModule.log`` builds (module.py:531-547: the strategy's ``reduce`` as sync function), so
    that the next ``self.log`` of a key finds its metadata equal (result.py:405-411) and accumulates on top, and the
    epoch's end computes over the whole epoch. Returns the names of those that cannot be put back: a custom
    ``sync_dist_group``, an unknown reduction, or a logged ``Metric`` the module no longer has."""
    results = trainer.fit_loop.epoch_loop._results
    device = trainer.strategy.root_device
    modules = dict(trainer.lightning_module.named_modules())
    missing = []
    for key, record in saved.items():
        reduce_fx = _REDUCTIONS.get(str(record.get("reduce_fx")))
        metric_object = modules.get(str(record.get("metric_attribute")))
        if record.get("sync_group") or reduce_fx is None or not (record["is_tensor"] or metric_object is not None):
            missing.append(str(record.get("name", key)))
            continue
        results[key] = _result_metric(trainer, record, reduce_fx, metric_object, device)
    return missing


def _result_metric(
    trainer: pl.Trainer, record: Mapping[str, Any], reduce_fx: Callable[..., Any], value: Any, device: torch.device
) -> _ResultMetric:
    meta = _Metadata(
        fx=record["fx"], name=record["name"], prog_bar=record["prog_bar"], logger=record["logger"],
        on_step=record["on_step"], on_epoch=record["on_epoch"], reduce_fx=reduce_fx,
        enable_graph=record["enable_graph"], add_dataloader_idx=record["add_dataloader_idx"],
        dataloader_idx=record["dataloader_idx"], metric_attribute=record["metric_attribute"],
    )  # fmt: skip
    meta.sync = _Sync(
        _should=record["sync_dist"], fn=trainer.strategy.reduce, _group=None, rank_zero_only=record["rank_zero_only"]
    )
    metric = _ResultMetric(meta, bool(record["is_tensor"]))
    if metric.is_tensor:
        metric.value = record["value"].to(device)
        if "cumulated_batch_size" in record:
            metric.cumulated_batch_size = record["cumulated_batch_size"].to(device)
    else:
        metric.value = value
    cache = record.get("forward_cache")
    metric._forward_cache = cache.to(device) if isinstance(cache, torch.Tensor) else None
    metric._update_count = int(record.get("updates", 0))
    metric.has_reset = False
    return metric


def continue_epoch_logging(trainer: pl.Trainer) -> None:
    """The logger connector as inside an epoch, past its first batch (logger_connector.py:187-191), so that the
    resumed epoch's first ``self.log`` of each hook does not reset what that hook logged before the save
    (``should_reset_tensors``, logger_connector.py:223-224, module.py:487-490), and ``callback_metrics`` read before
    the epoch's end has its step values, not its epoch values (logger_connector.py:240-250)."""
    trainer._logger_connector._first_loop_iter = False


def finish_epoch_metrics(trainer: pl.Trainer) -> None:
    """What the fit loop's epoch end does with the logged values after its end hooks (fit_loop.py:474,
    :486): the epoch's values computed, into ``callback_metrics`` and the progress bar's."""
    connector = trainer._logger_connector
    connector.epoch_end_reached()
    connector.on_epoch_end()


def log_epoch_metrics(trainer: pl.Trainer, step: int) -> None:
    """The fit loop's last step of an epoch end (fit_loop.py:494-498): the epoch's values to the loggers at
    ``step`` (the count of stepped batches, which the loop sets back to its last batch's there), then the
    collection reset."""
    loop = trainer.fit_loop.epoch_loop
    loop._batches_that_stepped, counted = step, loop._batches_that_stepped
    try:
        trainer._logger_connector.update_train_epoch_metrics()
    finally:
        loop._batches_that_stepped = counted


def batches_that_stepped(trainer: pl.Trainer) -> int:
    """The count of stepped batches loggers use as their step (training_epoch_loop.py:413-415), as restored."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)
