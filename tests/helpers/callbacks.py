"""Callbacks shared by in-process tests and the scripts they run in subprocesses."""

from __future__ import annotations

import os

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint


class SpyTarget(ModelCheckpoint):
    """A snapshot target that records when it was asked to save."""

    accepts_snapshots = True

    def __init__(self, dirpath: str) -> None:
        super().__init__(dirpath=dirpath, save_top_k=0)
        self.saves: list[tuple[int, str]] = []

    def save_snapshot(self, trainer: pl.Trainer, reason: str) -> str:
        self.saves.append((trainer.global_step, reason))
        path = os.path.join(str(self.dirpath), f"snap-{trainer.global_step}.ckpt")
        trainer.save_checkpoint(path)
        return path


class SaveAt(pl.Callback):
    """Save a checkpoint to ``path`` once, at the end of the batch that reaches global step ``step``."""

    def __init__(self, path: object, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.step and not self.path.exists():  # type: ignore[attr-defined]
            trainer.save_checkpoint(self.path)  # type: ignore[arg-type]


class CrashAt(pl.Callback):
    """Raise ``RuntimeError("crash")`` at the start of the batch at global step ``step`` (on ``rank`` only, when given)."""

    def __init__(self, step: int, rank: int | None = None) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            raise RuntimeError("crash")
