"""What Lightning itself leaves out of a resume, put back so that the resumed run is the uninterrupted one.

Three gaps of Lightning 2.6, each found by a kill-and-resume test:

- ``ReduceLROnPlateau`` steps after the batch (``interval="step"``) and after the epoch's end hooks
  (``"epoch"``), later than any checkpoint of that batch or epoch is written, and Lightning skips both on a
  resume: the step of the saved batch is never taken, nor the epoch's while the fit loop restarts. The resume
  takes the ones the checkpoint owes (``owed_plateau_steps``, after the restore is checked) and lets the fit
  loop take the resumed epoch's (``at_epoch_end``).
- ``ModelCheckpoint`` forgets which file it saved last: a resumed run with nothing left to save rewrote
  ``last.ckpt`` at train end, and ``save_last="link"`` had nothing to link to.
- ``CombinedLoader(mode="max_size")`` iterates every loader anew on a restart: one already exhausted in the
  saved epoch yielded again (its next epoch's batches). It stays exhausted (``restart_train_iterator``).

Decides from the saved record; the private names are in ``_compat.lightning_gaps``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import lightning.pytorch as pl

from lightning_resume._compat import lightning as lc
from lightning_resume._compat import lightning_gaps as gaps
from lightning_resume._compat.torchdata import hold_finished_position, iterator_finished

KEY = "lightning_gaps"
"""The entry of ``ExactResume``'s state (``capture.checkpoint_state``) this module writes and reads."""


def capture(trainer: pl.Trainer, after_batch: bool) -> dict[str, Any]:
    """What the resume needs of Lightning's own state at this save: each ``ModelCheckpoint``'s last file, and
    whether the plateau step of the batch just trained is still to come (a save in ``on_train_batch_end``)."""
    return {
        "checkpoints": gaps.last_saved_files(trainer),
        "batch_idx": gaps.batch_index(trainer),
        "step_plateau_owed": bool(after_batch and lc.at_optimizer_step(trainer)),
    }


def restore_callbacks(trainer: pl.Trainer, saved: Optional[Mapping[str, Any]]) -> None:
    """Put back each ``ModelCheckpoint``'s last saved file (a checkpoint without the record keeps Lightning's)."""
    gaps.restore_last_saved_files(trainer, dict((saved or {}).get("checkpoints") or {}))


def owed_plateau_steps(trainer: pl.Trainer, saved: Optional[Mapping[str, Any]], mine: Mapping[str, Any]) -> None:
    """Take the plateau steps the uninterrupted run took after the save and Lightning skips on this resume, after
    the restore was checked (they change the optimizer's learning rate) and before the next epoch starts.

    The batch's step: owed after a save in ``on_train_batch_end``, unless the restarted loop runs the rest of
    that batch itself (a validation due mid-epoch, ``lc.run_due_validation``). The epoch's: owed when the saved
    epoch had ended and Lightning counts it finished; an epoch it resumes inside is the fit loop's to step."""
    if saved is None:
        return
    exhausted = bool(mine.get("epoch_exhausted"))
    deferred_to_loop = bool(mine.get("validation_pending")) and not exhausted
    if saved.get("step_plateau_owed") and not deferred_to_loop:
        gaps.step_plateau_schedulers(trainer, "step", int(saved.get("batch_idx", 0)))
    if exhausted:
        lc.leave_finished_epoch(trainer)  # what start_next_epoch does first: then Lightning's count is final
        epoch = int(mine.get("epoch", trainer.current_epoch))
        if trainer.current_epoch > epoch:
            gaps.step_epoch_plateau_of(trainer, epoch)


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
