"""Every use of Lightning 2.6 internals, in one place.

Exact resume needs a few things Lightning keeps private: the training loaders after Lightning
processed them, the batches its fetcher has already prefetched, re-creating the training iterator
after a loader state was applied, and whether validation is due at the current step. Retention
extends ``ModelCheckpoint`` through its single-underscore methods; activation checkpointing hooks
the strategies' model setup. Each is one small function (or one overriding method) here, with the
file:line it relies on (lightning 2.6.6), so that a Lightning upgrade breaks one module, loudly,
and nothing else. ``lightning_resume._compat.check_versions`` warns when the version differs.
"""

from __future__ import annotations

import inspect
import re
import signal
from typing import Any, Callable, Mapping, Optional, Union, cast

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper, _DatasetSamplerWrapper
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loops.evaluation_loop import RestartStage
from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
from lightning.pytorch.loops.progress import _ProcessedTracker
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_resume._compat import torchdata as td
from lightning_resume.protocols import LastResolver
from lightning_resume.storage import files as storage


def train_loaders(trainer: pl.Trainer) -> list[Any]:
    """The training loaders as Lightning iterates them (fit_loop.py:239-251, after _process_dataloader)."""
    combined = trainer.fit_loop._combined_loader
    return list(combined.flattened) if combined is not None else []


def on_train_loader_processed(
    trainer: pl.Trainer, replace: Callable[[Any], Any], release: Optional[Callable[[], None]] = None
) -> Callable[[], None]:
    """Have ``replace`` see (and may replace) every training loader once Lightning has processed it.

    ``FitLoop.setup_data`` passes each training loader through ``_process_dataloader``
    (fit_loop.py:252-254), which calls ``strategy.process_dataloader`` after injecting a distributed
    sampler and before adding a ``worker_init_fn`` and creating the iterator (data_connector.py:494-507).
    ``replace`` wraps that strategy method on this instance. Returns the function that removes it and
    then calls ``release`` (which puts back what ``replace`` changed).
    """
    strategy = trainer.strategy
    original = strategy.process_dataloader

    def process_dataloader(dataloader: object) -> object:
        dataloader = original(dataloader)
        return replace(dataloader) if trainer.training else dataloader

    strategy.process_dataloader = process_dataloader  # type: ignore[method-assign]

    def remove() -> None:
        if strategy.__dict__.get("process_dataloader") is process_dataloader:
            del strategy.process_dataloader
        if release is not None:
            release()

    return remove


def sampler_inside_distributed_wrapper(sampler: Any) -> Any:
    """The user's sampler that Lightning's ``DistributedSamplerWrapper`` shards, or ``None`` for any other
    sampler (fabric/utilities/distributed.py:336, :367)."""
    if not isinstance(sampler, DistributedSamplerWrapper):
        return None
    return cast(_DatasetSamplerWrapper, sampler.dataset)._sampler


def drop_loader_state(checkpoint: dict[str, Any]) -> None:
    """Keep Lightning from loading its own loader state (fit_loop.py:498-506, :551-555).

    That state is taken one prefetched batch late for iterables and is applied before any check that
    the loaders still match (torchdata raises on a changed ``num_workers``). ExactResume applies its
    own, aligned state itself after checking. Only the in-memory dict is changed, never the file.
    """
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    fit_loop.get("state_dict", {}).pop("combined_loader", None)


def prefetched_batches(trainer: pl.Trainer) -> list[Any]:
    """Batches fetched from the loaders but not yet trained on (fetchers.py:104-117: iterables only)."""
    fetcher = trainer.fit_loop._data_fetcher
    return list(fetcher.batches) if isinstance(fetcher, _PrefetchDataFetcher) else []


def epoch_exhausted(trainer: pl.Trainer) -> bool:
    """Whether the last batch of the current epoch has been trained (training_epoch_loop.py:324)."""
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def inside_training_step(trainer: pl.Trainer) -> bool:
    """Whether a training batch has begun and its step not finished: the batch progress counts it ready
    before ``on_train_batch_start`` and processed only after the optimizer step, before
    ``on_train_batch_end`` (training_epoch_loop.py:324, :356, :375)."""
    progress = cast(_ProcessedTracker, trainer.fit_loop.epoch_loop.batch_progress.current)  # progress.py:_BatchProgress
    return progress.ready > progress.processed


def at_optimizer_step(trainer: pl.Trainer) -> bool:
    """Whether the batch just trained ended with an optimizer step (no gradients half accumulated,
    which checkpoints do not hold): training_epoch_loop.py:_should_accumulate."""
    return not trainer.fit_loop.epoch_loop._should_accumulate()


def validation_due(trainer: pl.Trainer) -> bool:
    """Whether validation runs after the current training batch (training_epoch_loop.py:390, :529)."""
    loop = trainer.fit_loop.epoch_loop
    fetcher = trainer.fit_loop._data_fetcher
    return fetcher is not None and bool(loop._should_check_val_fx(fetcher))


def restart_train_iterator(trainer: pl.Trainer, prefetched: Optional[list[Any]] = None) -> None:
    """Create a new training iterator, so loader states set with ``load_state_dict`` take effect.

    ``prefetched`` (for iterable loaders) are the batches the saving run had fetched ahead; they are
    put back in the fetcher's queue instead of being fetched again, so the loader is asked for the
    next batch at the same moment as in the uninterrupted run (fetchers.py:98-110).
    """
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is None:
        return
    if prefetched and isinstance(fetcher, _PrefetchDataFetcher):
        depth, fetcher.prefetch_batches = fetcher.prefetch_batches, 0
        try:
            iter(fetcher)
        finally:
            fetcher.prefetch_batches = depth
        fetcher.batches = list(prefetched)
        fetcher.fetched += len(prefetched)
    else:
        iter(fetcher)


def set_epoch_length(trainer: pl.Trainer, batches: int) -> Callable[[], None]:
    """Make the current epoch ``batches`` batches long, as if its loader had that length: the epoch loop's
    count (``num_training_batches``, training_epoch_loop.py:442-445), the fetcher's, which marks the last batch
    (fetchers.py:70-72), and a fractional ``val_check_interval``'s batch (fit_loop.py:316-318). Lightning
    computes them once from ``len(loader)`` (fit_loop.py:277-318); an elastic resume deals an epoch's rest
    of another length. Returns what puts Lightning's back (at the epoch's end: the next one is ordinary)."""
    fit_loop, fetcher = trainer.fit_loop, trainer.fit_loop._data_fetcher
    ordinary = (fit_loop.max_batches, trainer.val_check_batch)
    fit_loop.max_batches = batches
    if fetcher is not None:
        fetcher.length = batches
    if isinstance(trainer.val_check_interval, float) and trainer.val_check_batch not in (None, float("inf")):
        trainer.val_check_batch = max(1, int(batches * trainer.val_check_interval))

    def back() -> None:
        fit_loop.max_batches, trainer.val_check_batch = ordinary

    return back


def set_accumulation(trainer: pl.Trainer, batches: int) -> None:
    """Accumulate gradients over ``batches`` batches from now on; the loop reads the trainer's value at every
    batch (training_epoch_loop.py:440), counting windows by the epoch's batch index."""
    trainer.accumulate_grad_batches = batches


def leave_finished_epoch(trainer: pl.Trainer) -> None:
    """Restore a checkpoint saved in ``on_train_epoch_end`` as finished, as Lightning does with ``max_epochs``.

    With ``max_steps`` every loop stays "restarting" (fit_loop.py:139), so such a checkpoint restarts
    inside the finished epoch (RESTARTED_ON_EPOCH_END, fit_loop.py:361-367): the epoch loop trains one
    more batch from the next epoch's iterator (training_epoch_loop.py:125-133, not done while restarting),
    and the next epoch shuffles afresh and skips ``on_train_epoch_start``. Here the loops are put where a
    ``max_epochs`` resume has them: not restarting, RESUMED_ON_EPOCH_END, the epoch counted completed
    (fit_loop.py:368-374, :393-396).
    """
    fit_loop = trainer.fit_loop
    if not fit_loop.restarted_on_epoch_end:
        return
    # past FitLoop's setter, which keeps iteration-based loops restarting; the epoch loop's passes it down (loop.py:35-40)
    fit_loop._restarting = False
    fit_loop.epoch_loop.restarting = False
    fit_loop.update_restart_stage()
    if fit_loop.resumed_on_epoch_end:
        fit_loop.epoch_progress.increment_completed()


def restarted_inside_epoch(trainer: pl.Trainer) -> bool:
    """Whether Lightning restarts inside an epoch, and so skips ``on_train_epoch_start`` (fit_loop.py:354-360,
    :447-454). After a save on an epoch's last batch it has already counted that epoch finished
    (fit_loop.py:398-404): the hooks it skips are then the next epoch's, which never ran."""
    return trainer.fit_loop.restarted_mid_epoch


def next_epoch_start_skipped(trainer: pl.Trainer) -> bool:
    """Whether Lightning counted the saved epoch finished on restore and so skips the next epoch's start: a
    restart inside an epoch from a save in ``on_train_batch_end`` of its last batch (fit_loop.py:398-404). A save
    later in that batch (at the end of the validation run it triggered) restarts into the rest of the epoch,
    which Lightning finishes, then starts the next one itself (fit_loop.py:447-454)."""
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    return bool(
        fit_loop.restarted_mid_epoch
        and epoch_loop.restarted_on_train_batch_end
        and epoch_loop.batch_progress.is_last_batch
    )


def hook_overriders(trainer: pl.Trainer, hook: str) -> list[Any]:
    """The callbacks, then the LightningModule, that override ``hook``, in Lightning's call order
    (fit_loop.py:451-452, call.py:_call_callback_hooks)."""
    module = trainer.lightning_module
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by _CallbackConnector
    hooked = [cb for cb in callbacks if is_overridden(hook, cb, Callback)]
    return hooked + ([module] if is_overridden(hook, module, pl.LightningModule) else [])


def call_epoch_start(trainer: pl.Trainer, hooked: Any) -> None:
    """Call one callback's (or the module's) ``on_train_epoch_start`` as the fit loop does."""
    if isinstance(hooked, pl.LightningModule):
        call._call_lightning_module_hook(trainer, "on_train_epoch_start")
    else:
        hooked.on_train_epoch_start(trainer, trainer.lightning_module)


def start_next_epoch(trainer: pl.Trainer) -> None:
    """The part of fit_loop.on_advance_start that Lightning skips after a save on an epoch's last batch
    (fit_loop.py:447-454): count the epoch ready, call every ``on_train_epoch_start``, count it started."""
    progress = trainer.fit_loop.epoch_progress
    progress.increment_ready()
    call._call_callback_hooks(trainer, "on_train_epoch_start")
    call._call_lightning_module_hook(trainer, "on_train_epoch_start")
    progress.increment_started()


def apply_loader_states(loaders: list[Any]) -> None:
    """Apply pending loader states by creating one iterator each and dropping it.

    Used when the saved position is the end of an epoch: torchdata resumes such a state into an empty
    iterator, and the iterator after it starts the next epoch from the restored sampler state.
    """
    for loader in loaders:
        if getattr(loader, "next_iter_state", None) is not None:
            iterator = iter(loader)
            del iterator
            td.drop_finished_sampler_position(loader)


def set_sampler_epoch(loaders: list[Any], epoch: int) -> None:
    """What fit_loop.on_advance_start does before an epoch's iterator is made (fit_loop.py:428-430)."""
    for loader in loaders:
        _set_sampler_epoch(loader, epoch)


def defer_validation_to_loop(trainer: pl.Trainer) -> None:
    """Make the restarted epoch loop run the validation that was due right after the saved step.

    Lightning fast-forwards over it on resume (training_epoch_loop.py:281-292). Marking the val loop
    as restarted mid-evaluation makes the first ``advance`` return early and ``on_advance_end`` run a
    full validation (:390-406), at the same point of the RNG streams as the uninterrupted run.
    That ``on_advance_end`` also counts the step for loggers once more than the uninterrupted run
    did (reset() counted it already, :191-198), which is undone here.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    epoch_loop.val_loop._restart_stage = RestartStage.RESTARTED_MID_EVALUATION
    epoch_loop.val_loop.restarting = False
    if not epoch_loop._should_accumulate():
        epoch_loop._batches_that_stepped -= 1


def skip_validation_fast_forward(trainer: pl.Trainer) -> None:
    """Stop the restarted epoch loop from fast-forwarding over a validation once, at its first step.

    After a resume at an epoch boundary Lightning may "skip" a validation that the uninterrupted
    run never had at that point (training_epoch_loop.py:281-292); skipping it still iterates the
    validation loader (evaluation_loop.py:268-272, :256), which draws from the global RNG.
    """
    val_loop = trainer.fit_loop.epoch_loop.val_loop

    def once() -> None:
        del val_loop.increment_progress_to_evaluation_end  # back to the class method

    # a one-shot override on this instance (no Lightning hook for it); mypy refuses any method assignment
    val_loop.increment_progress_to_evaluation_end = once  # type: ignore[method-assign]


def run_due_validation(trainer: pl.Trainer, epoch_exhausted: bool, epoch: int) -> None:
    """The validation that was due right after the saved step (Lightning skips it on resume), once the RNG is
    restored: run now after a save at the end of epoch ``epoch`` (Lightning already counts that epoch finished;
    the validation still belongs to it), else left to the restarted epoch loop."""
    if epoch_exhausted:
        run_validation(trainer, epoch=epoch)
    else:
        defer_validation_to_loop(trainer)


def run_validation(trainer: pl.Trainer, epoch: int) -> None:
    """Run the validation that was due right after the saved step, as epoch_loop.on_advance_end does
    (training_epoch_loop.py:396-408); Lightning skips it on resume (training_epoch_loop.py:281-292).

    ``epoch`` is the epoch it belongs to. After a save on an epoch's last batch Lightning counts that
    epoch finished on restore (fit_loop.py:398-404), so ``trainer.current_epoch`` would be one too high
    for the validation's hooks, logged rows and checkpoint names; it reads ``epoch`` while it runs
    (``current_epoch`` is ``epoch_progress.current.completed``, trainer.py:1562-1564).
    """
    loop = trainer.fit_loop.epoch_loop
    # The restored val loop counts the saved run's finished validation; this one starts from scratch.
    loop.val_loop.restarting = False
    trainer.validating = True
    first_loop_iter = trainer._logger_connector._first_loop_iter
    if not loop._should_accumulate():
        call._call_lightning_module_hook(trainer, "on_validation_model_zero_grad")
    progress = trainer.fit_loop.epoch_progress.current
    progress.completed, counted = epoch, progress.completed
    try:
        loop.val_loop.run()
    finally:
        progress.completed = counted
    trainer.training = True
    trainer._logger_connector._first_loop_iter = first_loop_iter


# ------------------------------------------------------------------------------ logged metrics


def restore_callback_metrics(trainer: pl.Trainer, metrics: dict[str, Any]) -> None:
    """Put back the metrics ``trainer.callback_metrics`` held at the saved step, which checkpoint callbacks
    and early stopping read (``ModelCheckpoint._monitor_candidates``, model_checkpoint.py:703). Lightning's
    checkpoints do not hold them and ``_run`` empties them (trainer.py:1050); the values logged since come
    on top (logger_connector.py:247-251)."""
    trainer._logger_connector._callback_metrics.update(metrics)


# ------------------------------------------------------------------------------ ModelCheckpoint


class ModelCheckpointExtension(ModelCheckpoint):
    """``ModelCheckpoint`` whose private top-k save (``_save_topk_checkpoint``, model_checkpoint.py:574, called by
    every monitored or periodic save) is routed to an overridable method. "last" resolution is not here:
    :func:`resolve_last_through_callbacks` routes every ``ModelCheckpoint``'s."""

    @override
    def _save_topk_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict[str, torch.Tensor]) -> None:
        self.topk_save(trainer, monitor_candidates)

    def topk_save(self, trainer: pl.Trainer, monitor_candidates: dict[str, torch.Tensor]) -> None:
        """Lightning's top-k save; subclasses replace it."""
        super()._save_topk_checkpoint(trainer, monitor_candidates)


def save_checkpoint_file(callback: ModelCheckpoint, trainer: pl.Trainer, path: str) -> None:
    """Write ``path`` as ``ModelCheckpoint`` does, recording the step saved (model_checkpoint.py:593-605)."""
    callback._save_checkpoint(trainer, path)


def remove_checkpoint_file(callback: ModelCheckpoint, trainer: pl.Trainer, path: str) -> None:
    """Delete through the strategy (rank 0 only), as ``ModelCheckpoint`` does (model_checkpoint.py:1028)."""
    callback._remove_checkpoint(trainer, path)


def monitor_candidates(callback: ModelCheckpoint, trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """The logged metrics a save may monitor (model_checkpoint.py:896)."""
    return callback._monitor_candidates(trainer)


def last_global_step_saved(callback: ModelCheckpoint) -> int:
    """The global step of the callback's newest save (model_checkpoint.py:291, :601)."""
    return int(callback._last_global_step_saved)


def saving_callback() -> Optional[ModelCheckpoint]:
    """The ``ModelCheckpoint`` whose save is running now, from the call stack (``_save_checkpoint`` calls
    ``trainer.save_checkpoint``, then sets ``_last_global_step_saved``: model_checkpoint.py:593-601); ``None``
    for a save no ``ModelCheckpoint`` started (a memory-tier snapshot, ``trainer.save_checkpoint``)."""
    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "_save_checkpoint" and isinstance(owner, ModelCheckpoint):
            return owner
        frame = frame.f_back
    return None


def last_saved_steps(trainer: pl.Trainer) -> dict[str, int]:
    """Each checkpoint callback's step of its newest save, as it is once the save being written completes: a
    resumed run that saved at step s must not save step s again (under gradient accumulation the next
    micro-batch ends at the same global step; model_checkpoint.py:631/639 skip only a step already saved),
    and Lightning's checkpoints do not hold it (``ModelCheckpoint.state_dict`` leaves it out)."""
    saving = saving_callback()
    return {
        cb.state_key: trainer.global_step if cb is saving else int(cb._last_global_step_saved)
        for cb in trainer.checkpoint_callbacks
        if isinstance(cb, ModelCheckpoint)
    }


def restore_last_saved_steps(trainer: pl.Trainer, steps: Mapping[str, Any]) -> None:
    """Put back what :func:`last_saved_steps` recorded, per callback (a callback not recorded keeps its own)."""
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and isinstance(steps.get(cb.state_key), int):
            cb._last_global_step_saved = int(steps[cb.state_key])


def checkpoint_dir(callback: ModelCheckpoint, trainer: pl.Trainer) -> str:
    """Where ``setup`` will put the callback's checkpoints, before ``setup`` ran.

    Mirrors the name-mangled ``ModelCheckpoint.__resolve_ckpt_dir`` (model_checkpoint.py:837-865),
    which a subclass cannot call.
    """
    if callback.dirpath is not None:
        return str(callback.dirpath)
    if trainer.loggers:
        logger = trainer.loggers[0]
        save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
        version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
        return storage.join(storage.join(storage.join(str(save_dir), str(logger.name)), version), "checkpoints")
    return storage.join(str(trainer.default_root_dir), "checkpoints")


_LIGHTNING_FIND_LAST = ModelCheckpoint._find_last_checkpoints


def _find_last(self: ModelCheckpoint, trainer: pl.Trainer) -> set[str]:
    """``ModelCheckpoint._find_last_checkpoints`` (model_checkpoint.py:867-877), which
    ``_CheckpointConnector._parse_ckpt_path`` (checkpoint_connector.py:181-194) asks of every checkpoint
    callback for ``ckpt_path="last"`` before ``setup``, then takes the newest answer by modification time.

    A ``LastResolver`` among the trainer's callbacks answers for ``fit`` (the same file for every callback).
    Without one, and for ``validate``/``test``/``predict``, Lightning's rule (``last``, ``last-vN``; the callback's extension), with URLs kept: Lightning's own
    ``os.path.normpath``s what the filesystem lists, so ``s3://b/run/last.ckpt`` became the local path
    ``b/run/last.ckpt``, found missing, and the run silently started from step 0. Local directories
    without a resolver go to Lightning's code unchanged.
    """
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # assigned by Lightning's callback connector
    resolver = next((cb for cb in callbacks if isinstance(cb, LastResolver) and cb.resolves_last), None)
    if resolver is not None and trainer.state.fn == TrainerFn.FITTING:  # validate/test/predict: Lightning's rule
        return resolver.resolve_last(trainer)
    directory = checkpoint_dir(self, trainer)
    if not storage.is_remote(directory):
        return _LIGHTNING_FIND_LAST(self, trainer)
    pattern = re.compile(rf"^{re.escape(self.CHECKPOINT_NAME_LAST)}(-(\d+))?")
    return {
        e.path
        for e in storage.list_dir(directory)
        if not e.is_dir and e.name.endswith(self.FILE_EXTENSION) and pattern.match(e.name[: -len(self.FILE_EXTENSION)])
    }


_find_last.__name__ = "_find_last_checkpoints"  # a bound method pickles by its name


def resolve_last_through_callbacks() -> None:
    """Route every ``ModelCheckpoint``'s "last" search (model_checkpoint.py:867) through :func:`_find_last`, so a
    ``LastResolver`` decides, and stock callbacks resume from ``s3://`` too. Idempotent; without a resolver,
    local directories behave exactly as before. Called by the constructors of ``ExactResume``,
    ``SafetensorsCheckpointIO`` and ``RetentionCheckpoint``."""
    if ModelCheckpoint._find_last_checkpoints is _LIGHTNING_FIND_LAST:
        ModelCheckpoint._find_last_checkpoints = _find_last  # type: ignore[method-assign]
    remember_fit_weights_only()  # "last" is resolved with the user's weights_only


_LIGHTNING_FIT_IMPL = pl.Trainer._fit_impl


def _fit_impl_remembering(
    self: pl.Trainer,
    model: Any,
    train_dataloaders: Any = None,
    val_dataloaders: Any = None,
    datamodule: Any = None,
    ckpt_path: Any = None,
    weights_only: Optional[bool] = None,
) -> None:
    self._lightning_resume_weights_only = weights_only  # type: ignore[attr-defined]  # read by fit_weights_only
    return _LIGHTNING_FIT_IMPL(self, model, train_dataloaders, val_dataloaders, datamodule, ckpt_path, weights_only)


_fit_impl_remembering.__name__ = "_fit_impl"  # ddp_spawn pickles ``trainer._fit_impl`` by this name (issue 39 suite)


def remember_fit_weights_only() -> None:
    """Keep the ``weights_only`` a ``fit`` was called with: ``Trainer.fit`` (trainer.py:522-593) hands it to
    ``_fit_impl`` (trainer.py:595-630), which resolves ``ckpt_path`` ("last", checkpoint_connector.py:86-114)
    before the strategy's ``load_checkpoint`` receives it (checkpoint_connector.py:83), so a resolver that
    verifies candidates never sees it otherwise. Idempotent. A process started by ``ddp_spawn`` runs
    ``_fit_impl`` unpatched unless something of ours was constructed there (then the default, weights-only)."""
    if pl.Trainer._fit_impl is _LIGHTNING_FIT_IMPL:
        pl.Trainer._fit_impl = _fit_impl_remembering  # type: ignore[method-assign]


def fit_weights_only(trainer: pl.Trainer) -> Optional[bool]:
    """The ``weights_only`` the current (or last) ``fit`` of ``trainer`` was called with (``None``: not given,
    Lightning's default, which ``torch.load`` takes as ``True`` since torch 2.6)."""
    value = getattr(trainer, "_lightning_resume_weights_only", None)
    return value if isinstance(value, bool) else None


# ------------------------------------------------------------------------------ checkpoint loading


def dump_checkpoint(trainer: pl.Trainer) -> dict[str, Any]:
    """The full checkpoint dict ``trainer.save_checkpoint`` would write, built on this rank
    (checkpoint_connector.py:416, trainer.py:1385). Calls every callback's ``state_dict`` (collectives
    included), so every rank calls it."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


_LIGHTNING_SELECT_CKPT_PATH = _CheckpointConnector._select_ckpt_path


def _select_remembering_request(self: _CheckpointConnector, state_fn: Any, ckpt_path: Any, **kwargs: Any) -> Any:
    self._lightning_resume_requested = ckpt_path  # type: ignore[attr-defined]  # read by requested_ckpt_path
    return _LIGHTNING_SELECT_CKPT_PATH(self, state_fn, ckpt_path, **kwargs)


_select_remembering_request.__name__ = "_select_ckpt_path"  # a bound method pickles by its name


def remember_ckpt_path_requests() -> None:
    """Keep the ``ckpt_path`` a ``fit`` was called with (``"last"``), which Lightning resolves to a file
    before any callback runs (trainer.py:624, checkpoint_connector.py:86-114). Idempotent."""
    if _CheckpointConnector._select_ckpt_path is _LIGHTNING_SELECT_CKPT_PATH:
        _CheckpointConnector._select_ckpt_path = _select_remembering_request  # type: ignore[method-assign,assignment]


def requested_ckpt_path(trainer: pl.Trainer) -> Any:
    """The ``ckpt_path`` the current ``fit`` was called with (after :func:`remember_ckpt_path_requests`)."""
    return getattr(trainer._checkpoint_connector, "_lightning_resume_requested", None)


Chooser = Callable[[Optional[str]], Union[tuple[str, dict[str, Any]], str, None]]
"""Given the checkpoint Lightning resolved (or ``None``): a ``(path, loaded checkpoint)`` to restore instead, or the
path of the checkpoint file Lightning loads and restores (``None``: none, a fresh start)."""


def substitute_checkpoint(trainer: pl.Trainer, choose: Chooser) -> Callable[[], None]:
    """Let ``choose`` replace the checkpoint the trainer restores, at ``resume_start``
    (checkpoint_connector.py:67-84, which sets ``trainer.ckpt_path`` to the path it is given): after ``setup``
    hooks (the process group exists), before any state is restored (trainer.py:1046, :1066). Returns the
    function that removes the hook."""
    connector = trainer._checkpoint_connector
    original = connector.resume_start

    def resume_start(checkpoint_path: Any = None, weights_only: Optional[bool] = None) -> None:
        chosen = choose(str(checkpoint_path) if checkpoint_path else None)
        if chosen is None or isinstance(chosen, str):
            return original(chosen, weights_only=weights_only)
        path, checkpoint = chosen
        rank_zero_info(f"Restoring states from the checkpoint at {path}")
        connector._ckpt_path = path
        connector._loaded_checkpoint = _pl_migrate_checkpoint(checkpoint, path)
        return None

    connector.resume_start = resume_start  # type: ignore[method-assign]

    def remove() -> None:
        if connector.__dict__.get("resume_start") is resume_start:
            del connector.resume_start

    return remove


# ------------------------------------------------------------------------------------ strategies


class ModelSetupHook(Strategy):
    """Mixin for a ``Strategy`` subclass (listed first): ``prepare_model`` runs inside ``_setup_model``.

    Lightning calls ``_setup_model`` after ``configure_model`` and precision conversion, before any
    wrapper (strategy.py:253; ddp.py:158-196 wraps in DDP there, fsdp.py:292-352 in FSDP), so it is the
    one place that sees every layer and no wrapper yet, whatever the strategy.
    """

    def prepare_model(self, model: nn.Module) -> None:
        """Change ``model`` in place before the strategy wraps it."""

    @override
    def _setup_model(self, model: nn.Module) -> Any:  # Any: DDPStrategy narrows it to DistributedDataParallel
        self.prepare_model(model)
        return super()._setup_model(model)


def set_fsdp_checkpoint_fn(strategy: Any, check_fn: Callable[[nn.Module], bool]) -> None:
    """Have ``FSDPStrategy`` apply its native activation checkpointing to the modules ``check_fn`` picks
    (fsdp.py:191 stores these kwargs, :322 applies them while wrapping)."""
    strategy._activation_checkpointing_kwargs = {"check_fn": check_fn}


# ----------------------------------------------------------------------------------------- logging


def metrics_lightning_resets(trainer: pl.Trainer) -> list[Any]:
    """The ``torchmetrics`` objects logged with ``self.log`` in validation, which Lightning resets before their
    next update when a checkpoint is taken now (after ``on_validation_end``, where checkpoints are saved:
    evaluation_loop.py:363). Training's are not: at an epoch's end the resume completes the epoch from the
    metric's full state (``exact.lightning_gaps``) and Lightning resets it then. ``_ResultMetric.value`` is the
    logged metric (result.py:186)."""
    loop = trainer.fit_loop.epoch_loop.val_loop
    return [item.value for item in loop._results.values() if not item.is_tensor]


# ---------------------------------------------------------------------------------------- launchers


def slurm_requeue_signal(trainer: pl.Trainer) -> Optional[signal.Signals]:
    """The signal on which Lightning's SLURM environment saves and requeues the job, or ``None`` when it
    would not requeue (not on SLURM, or ``auto_requeue=False``): signal_connector.py:51-62."""
    environment = trainer._accelerator_connector.cluster_environment
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and environment.requeue_signal:
        return signal.Signals(environment.requeue_signal)
    return None


def hpc_save_path(trainer: pl.Trainer) -> str:
    """The next ``hpc_ckpt_N.ckpt`` in ``default_root_dir``, which ``fit(ckpt_path=None)`` resumes from on
    SLURM (checkpoint_connector.py:55-64, :121-122, :563-566)."""
    return str(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))


def saves_directories(strategy: Strategy) -> bool:
    """Whether ``strategy`` writes each checkpoint itself as a directory of shards, not through its
    ``CheckpointIO``: ``FSDPStrategy(state_dict_type="sharded")`` (fsdp.py:194, :563-566),
    ``ModelParallelStrategy(save_distributed_checkpoint=True)`` (model_parallel.py:94, :312-316), and
    ``DeepSpeedStrategy`` (deepspeed.py:669, its engine's own directory)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    if isinstance(strategy, DeepSpeedStrategy):
        return True
    if isinstance(strategy, FSDPStrategy):
        return bool(strategy._state_dict_type == "sharded")
    return isinstance(strategy, ModelParallelStrategy) and bool(strategy._save_distributed_checkpoint)


def combined_mode(trainer: pl.Trainer) -> Optional[str]:
    """The ``CombinedLoader`` mode of the train loaders (``"max_size_cycle"``, ``"max_size"``, ``"min_size"``,
    ``"sequential"``), or ``None`` before they are set up (fit_loop.py:239-251, combined_loader.py:289)."""
    combined = trainer.fit_loop._combined_loader
    return None if combined is None else str(combined._mode)


def last_checkpoint_saved(callback: ModelCheckpoint) -> str:
    """The path of the callback's newest save in this fit, ``""`` before any (model_checkpoint.py:299, :602)."""
    return str(callback._last_checkpoint_saved or "")
