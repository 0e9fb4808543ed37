"""Tiny model and data shared by the retention tests (and their subprocess scripts)."""

from __future__ import annotations

import os

import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset


class TinyModel(LightningModule):
    """A linear regressor that logs ``val/loss`` (for monitor tests)."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class TinyData(LightningDataModule):
    def __init__(self, n: int = 32, batch_size: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, 4, generator=g)
        self.data = TensorDataset(x, x.sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g))
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)


def tiny_trainer(callbacks, **kwargs) -> Trainer:
    options = dict(
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        accelerator="cpu", devices=1, limit_val_batches=2, num_sanity_val_steps=0,
    )
    options.update(kwargs)
    return Trainer(callbacks=callbacks, **options)


def listing(dirpath) -> list:
    """File names under ``dirpath`` (relative, sorted)."""
    out = []
    for root, _, names in os.walk(dirpath):
        out += [os.path.relpath(os.path.join(root, n), dirpath) for n in names]
    return sorted(out)
