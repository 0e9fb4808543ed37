"""What Lightning itself leaves out of a resume, put back so that the resumed run is the uninterrupted one.

The gaps of Lightning 2.6, each found by a kill-and-resume test:

- ``ReduceLROnPlateau`` steps after the batch (``interval="step"``) and after the epoch's end hooks
  (``"epoch"``), later than any checkpoint of that batch or epoch is written, and Lightning skips both on a
  resume: the step of the saved batch is never taken, nor the epoch's while the fit loop restarts. The resume
  takes the ones the checkpoint owes (``owed_after_save``, after the restore is checked) and lets the fit
  loop take the resumed epoch's (``at_epoch_end``).
- ``ModelCheckpoint`` forgets which file it saved last: a resumed run with nothing left to save rewrote
  ``last.ckpt`` at train end, and ``save_last="link"`` had nothing to link to.
- ``CombinedLoader(mode="max_size")`` iterates every loader anew on a restart: one already exhausted in the
  saved epoch yielded again (its next epoch's batches). It stays exhausted (``restart_train_iterator``).
- What ``self.log(..., on_epoch=True)`` accumulated in the epoch is in no checkpoint: a resumed epoch's value
  covered the resumed batches only, and everything monitoring it (plateau schedulers, best-k, early stopping)
  decided on it. Each rank's accumulation is saved and put back (``capture_rank``, ``restore_logged``).
- ``CombinedLoader(mode="max_size_cycle")`` ends an epoch when every loader has run out once; a restart forgot
  which had: with loaders without a length the resumed epoch ran on. The flags are put back.
- After a save on an epoch's last batch or in its end hooks, Lightning counts the epoch finished and skips the
  rest of its end: its logged values never reach ``callback_metrics`` or the loggers, its plateau step reads a
  stale monitor. The resume ends it (``end_saved_epoch``). After a save at the end of the validation that
  batch ran, Lightning ends the epoch itself and starts the next one: the resume must not (``next_epoch_is_ours``;
  it did, and the next epoch's order came from a second draw).

Decides from the saved record; the private names are in ``_compat.lightning_gaps``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from lightning_resume._compat import lightning as lc
from lightning_resume._compat import lightning_gaps as gaps
from lightning_resume._compat.torchdata import hold_finished_position, iterator_finished
from lightning_resume.errors import ExactResumeWarning

KEY = "lightning_gaps"
"""The entry of ``ExactResume``'s state (``capture.checkpoint_state``) this module writes and reads."""


def capture(trainer: pl.Trainer, after_batch: bool) -> dict[str, Any]:
    """What the resume needs of Lightning's own state at this save: each ``ModelCheckpoint``'s last file, and
    whether the save came right after a batch (in ``on_train_batch_end``), whose plateau step is then to come."""
    return {
        "checkpoints": gaps.last_saved_files(trainer),
        "batch_idx": gaps.batch_index(trainer),
        "after_batch": bool(after_batch),
        "step_plateau_owed": bool(after_batch and lc.at_optimizer_step(trainer)),
    }


def capture_rank(trainer: pl.Trainer) -> dict[str, Any]:
    """This rank's part (under ``KEY`` in its state): the values logged with ``self.log`` in the training epoch
    so far (each rank accumulates its own), and which loaders a ``max_size_cycle`` ``CombinedLoader`` has cycled."""
    return {"logged": gaps.logged_results(trainer), "cycle_consumed": gaps.cycle_consumed(trainer)}


def restore_callbacks(trainer: pl.Trainer, saved: Optional[Mapping[str, Any]]) -> None:
    """Put back each ``ModelCheckpoint``'s last saved file (a checkpoint without the record keeps Lightning's)."""
    gaps.restore_last_saved_files(trainer, dict((saved or {}).get("checkpoints") or {}))


def restore_logged(trainer: pl.Trainer, mine: Mapping[str, Any]) -> list[str]:
    """Put back what this rank had logged in the saved epoch, so that the epoch's values (``on_epoch=True``) cover
    the whole epoch, as in the uninterrupted run; return one line per value that cannot be (warned once).
    A rank an elastic resume added has none: its epoch values cover the batches it trains."""
    if int(mine.get("rank", trainer.global_rank)) != trainer.global_rank:
        return []
    missing = gaps.restore_logged_results(trainer, dict((mine.get(KEY) or {}).get("logged") or {}))
    gaps.continue_epoch_logging(trainer)  # right after the saved batch; an epoch it ended ends in owed_after_save
    if not missing:
        return []
    line = (
        f"the epoch values of {sorted(missing)} logged before the save (logged with a sync_dist_group, or a"
        " torchmetrics Metric the module no longer holds) are not put back: they cover the resumed batches only"
    )
    rank_zero_warn(f"ExactResume: {line}", category=ExactResumeWarning)
    return [line]


def owed_after_save(trainer: pl.Trainer, saved: Optional[Mapping[str, Any]], mine: Mapping[str, Any]) -> None:
    """Do what the uninterrupted run did after the save and Lightning skips on this resume, after the restore was
    checked (it changes the optimizer's learning rate) and before the next epoch starts.

    The batch's plateau step: owed after a save in ``on_train_batch_end``, unless the restarted loop runs the rest
    of that batch itself (a validation due mid-epoch, ``lc.run_due_validation``). The saved epoch's end, after
    its end hooks: owed when the saved epoch had ended and Lightning counts it finished (``next_epoch_is_ours``):
    its logged values computed (into ``callback_metrics``), its plateau step, its row to the loggers. An epoch
    Lightning resumes inside is the fit loop's to end."""
    if saved is None:
        return
    exhausted = bool(mine.get("epoch_exhausted"))
    deferred_to_loop = bool(mine.get("validation_pending")) and not exhausted
    if saved.get("step_plateau_owed") and not deferred_to_loop:
        gaps.step_plateau_schedulers(trainer, "step", int(saved.get("batch_idx", 0)))
    if next_epoch_is_ours(trainer, mine):
        lc.leave_finished_epoch(trainer)  # what start_next_epoch does first: then Lightning's count is final
        epoch = int(mine.get("epoch", trainer.current_epoch))
        if trainer.current_epoch > epoch:
            end_saved_epoch(trainer, epoch, after_batch=bool(saved.get("after_batch")))


def end_saved_epoch(trainer: pl.Trainer, epoch: int, after_batch: bool) -> None:
    """The end of finished epoch ``epoch`` after its hooks (fit_loop.py:486-498), which Lightning skips after a
    save on its last batch or in its end hooks. The row goes to the step of the epoch's last batch: the restored
    count of stepped batches, which the saving run had advanced past it unless it saved in ``on_train_batch_end``."""
    step = gaps.batches_that_stepped(trainer) - (0 if after_batch else 1)
    with gaps.reading_epoch(trainer, epoch):
        gaps.finish_epoch_metrics(trainer)
        gaps.step_epoch_plateau(trainer, epoch)
        gaps.log_epoch_metrics(trainer, step)


def next_epoch_is_ours(trainer: pl.Trainer, mine: Mapping[str, Any]) -> bool:
    """Whether the resume starts the next epoch itself (``restore.start_next_epoch``): after a save at an epoch's
    end, which Lightning counts finished, unless Lightning finishes that epoch itself (a save at the end of the
    validation its last batch ran: its end hooks, then the next epoch's start and iterator, are still to come)."""
    return bool(mine.get("epoch_exhausted")) and not gaps.finishes_saved_epoch(trainer)


def at_epoch_end(trainer: pl.Trainer) -> None:
    """At a training epoch's end: the fit loop steps the epoch's plateau schedulers even in a resumed epoch."""
    gaps.end_restart_before_epoch_plateau(trainer)


def exhausted_loaders(trainer: pl.Trainer, states: list[Any]) -> set[int]:
    """The training loaders a ``CombinedLoader(mode="max_size")`` had run out of in the saved epoch (their saved
    iterator had finished); other modes cycle them (``max_size_cycle``) or end the epoch (``min_size``)."""
    if gaps.combined_mode(trainer) != "max_size":
        return set()
    return {i for i, state in enumerate(states) if iterator_finished(state)}


def restart_train_iterator(trainer: pl.Trainer, mine: Mapping[str, Any]) -> None:
    """Make the resumed epoch's training iterator, with the saved prefetched batches, each exhausted loader
    still exhausted (before the RNG is restored: what loading its position draws is put back)."""
    exhausted = exhausted_loaders(trainer, list(mine.get("loaders") or []))
    loaders = lc.train_loaders(trainer)
    for i in exhausted:
        hold_finished_position(loaders[i])
    gaps.restart_with_exhausted(trainer, exhausted, lambda: lc.restart_train_iterator(trainer, mine["prefetched"]))
    consumed = (mine.get(KEY) or {}).get("cycle_consumed")
    if consumed is not None:  # the loaders already cycled in the saved epoch: the epoch ends at the same batch
        gaps.set_cycle_consumed(trainer, list(consumed))
