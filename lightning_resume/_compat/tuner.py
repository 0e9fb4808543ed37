"""Lightning's restores of its own temporary checkpoints (the Tuner's), told apart from a resume.

``lr_find`` and ``scale_batch_size`` (as ``Tuner`` methods and as the ``LearningRateFinder`` /
``BatchSizeFinder`` callbacks) save the trainer with ``trainer.save_checkpoint`` before their trial
steps and put it back afterwards with ``_CheckpointConnector.restore`` (tuner/lr_finder.py:241-243, :288;
tuner/batch_size_scaling.py:77-78, :108), the connector's restore-everything-at-once, which nothing else
in Lightning 2.6 calls (a resume goes through ``_restore_modules_and_callbacks`` and
``restore_training_state``, trainer.py:1046-1070). That restore calls every callback's ``load_state_dict``
and ``on_load_checkpoint`` as a resume does; it leaves ``trainer.ckpt_path`` naming the temporary file,
which it then deletes; and when a finder callback runs in ``on_fit_start`` of a resumed fit, it empties the
resume's loaded checkpoint before Lightning restores the loops and optimizers from it (trainer.py:1057-1070),
so the resume silently starts again from step 0 with the checkpoint's weights. Here, on one trainer's
connector: whether such a restore is running; and afterwards the trainer's ``ckpt_path`` and loaded
checkpoint as they were before it (the checkpoint the fit resumes from, or none). Knows Lightning's
connector only; decides nothing about what a callback does then.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import lightning.pytorch as pl

_FLAG = "_lightning_resume_restoring_own_checkpoint"


def mark_own_restores(trainer: pl.Trainer) -> Callable[[], None]:
    """While ``trainer``'s connector restores a checkpoint of Lightning's own (checkpoint_connector.py:233),
    :func:`restoring_own_checkpoint` is true; afterwards ``trainer.ckpt_path`` is what it was before. Idempotent
    per trainer; returns the function that removes the hook."""
    connector = trainer._checkpoint_connector
    if _FLAG in connector.__dict__:
        return lambda: None
    original = connector.restore

    def restore(checkpoint_path: Any = None, weights_only: Optional[bool] = None) -> None:
        # resume_start (checkpoint_connector.py:76-84) overwrites both, and resume_end (:229) empties the second,
        # which a resume in progress still restores the training state from (trainer.py:1070)
        resumed_from, resuming = connector._ckpt_path, connector._loaded_checkpoint
        setattr(connector, _FLAG, True)
        try:
            original(checkpoint_path, weights_only=weights_only)
        finally:
            setattr(connector, _FLAG, False)
            connector._ckpt_path, connector._loaded_checkpoint = resumed_from, resuming

    connector.restore = restore  # type: ignore[method-assign]
    setattr(connector, _FLAG, False)

    def remove() -> None:
        if connector.__dict__.get("restore") is restore:
            del connector.restore
            connector.__dict__.pop(_FLAG, None)

    return remove


def restoring_own_checkpoint(trainer: Optional[pl.Trainer]) -> bool:
    """Whether ``trainer`` is restoring a temporary checkpoint of Lightning's own (the Tuner's) right now."""
    return trainer is not None and bool(getattr(trainer._checkpoint_connector, _FLAG, False))
