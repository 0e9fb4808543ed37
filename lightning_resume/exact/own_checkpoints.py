"""What ``ExactResume`` does with the checkpoints Lightning saves and restores for itself, and with the
trainers and warnings of Lightning that are not its to serve.

The Tuner (``lr_find``, ``scale_batch_size``, and their callbacks) saves the trainer before its trial
steps and restores it after them (``_compat.tuner``). That save is not a checkpoint of the run and that
restore is not a resume: the state ``ExactResume`` holds (a resume still to be applied at train start, the
digests of the checkpoint loaded) must come out of it untouched, and a fit after it starts as it would
without ``ExactResume``. A save made before training started in this fit holds no training position (the
loaders do not exist yet; a resume's state is not applied yet), so it records none: a resume from it
starts the run over, as from a checkpoint saved after ``fit``. A resume that restored every train loader's
position says so in one line, in place of Lightning's warning that the loader is not resumable.
Decides; the Lightning internals are ``_compat``'s.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from lightning_resume._compat import lightning_warnings, tuner
from lightning_resume.errors import ConfigurationError
from lightning_resume.exact.capture import OUTSIDE_FIT

BEFORE_TRAINING = "before_training"
"""``captured_at`` of a save in a fit before its training started (the Tuner's, one in ``on_fit_start``)."""

NO_POSITION = (OUTSIDE_FIT, BEFORE_TRAINING)
"""``captured_at`` of a state that holds no training position (nothing to resume)."""


def has_position(state: Optional[Mapping[str, Any]]) -> bool:
    """Whether ``ExactResume``'s entry of a checkpoint holds a training position to resume."""
    if not state:
        return False
    return state.get("captured_at") not in NO_POSITION


def without_position(captured_at: Any) -> str:
    """Why a checkpoint with ``ExactResume``'s entry holds no training position, for the resume's warning."""
    if captured_at == BEFORE_TRAINING:
        return "saved before training started (trainer.save_checkpoint() in setup or on_fit_start)"
    return "saved outside fit (trainer.save_checkpoint() after training)"


def check_trainer(trainer: Any) -> None:
    """Refuse a trainer that is not ``lightning.pytorch``'s: a ``pytorch_lightning.Trainer`` calls this
    callback's hooks, but none of the Lightning internals it relies on is that trainer's."""
    if isinstance(trainer, pl.Trainer):
        return
    kind = f"{type(trainer).__module__.split('.')[0]}.{type(trainer).__name__}"
    raise ConfigurationError("ExactResume", [
        f"the trainer is a {kind}, not a lightning.pytorch.Trainer: ExactResume works with the `lightning` package"
        " only. Import Lightning as `import lightning.pytorch as pl` (and `from lightning.pytorch.callbacks"
        " import ...`) instead of `import pytorch_lightning as pl`"
    ])  # fmt: skip


class OwnCheckpoints:
    """Per fit: whether its training has started, and the hooks that tell Lightning's own restores apart and
    quiet Lightning's loader warning on a resume that restored every loader (put back by ``release``)."""

    def __init__(self) -> None:
        self.training_started = False
        self._removers: list[Callable[[], None]] = []

    def setup(self, trainer: pl.Trainer) -> None:
        """At ``setup("fit")``: no training yet; Lightning's own restores are marked from now on."""
        self.training_started = False
        self._removers.append(tuner.mark_own_restores(trainer))

    def before_training(self, trainer: pl.Trainer) -> bool:
        """Whether a save now falls in a fit before its training started."""
        return trainer.training and not self.training_started

    @staticmethod
    def restoring(trainer: Optional[pl.Trainer]) -> bool:
        """Whether Lightning is restoring a checkpoint of its own (not a resume) right now."""
        return tuner.restoring_own_checkpoint(trainer)

    def train_started(self, trainer: pl.Trainer, resumed_every_loader: bool) -> None:
        """At ``on_train_start``, after the restore. ``resumed_every_loader``: a resume restored the position of
        every train loader, so Lightning's warning that they are not resumable is wrong: replaced by ours."""
        self.training_started = True
        if resumed_every_loader:
            self._removers.append(lightning_warnings.quiet_unresumable_loader_warning(trainer))
            rank_zero_info(
                f"ExactResume: resumed at step {trainer.global_step}; every train loader goes on from its saved position"
            )

    def release(self) -> None:
        for remove in reversed(self._removers):
            remove()
        self._removers.clear()
