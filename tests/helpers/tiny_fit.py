"""A tiny LightningModule and a quiet single-process CPU trainer, for in-process fits in unit tests."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)

    def train_dataloader(self):
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def tiny_trainer(root, max_steps, callbacks, io):
    return Trainer(
        default_root_dir=str(root), max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", devices=1, callbacks=callbacks, plugins=[io],
    )  # fmt: skip
