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
