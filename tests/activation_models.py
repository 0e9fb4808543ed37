"""Tiny models shared by the activation-checkpointing tests (importable by subprocesses and YAML)."""

from __future__ import annotations

import torch
from lightning import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

WIDTH = 16


class Block(nn.Module):
    """Pre-norm residual MLP block with dropout: saves LayerNorm, matmul and mask activations."""

    def __init__(self, width: int = WIDTH, dropout: float = 0.2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class Stack(LightningModule):
    """A stack of Blocks in an ``nn.Sequential`` (``sequential=True``) or an ``nn.ModuleList``."""

    def __init__(self, n_blocks: int = 4, sequential: bool = True, lr: float = 0.05) -> None:
        super().__init__()
        blocks = [Block() for _ in range(n_blocks)]
        self.layers = nn.Sequential(*blocks) if sequential else nn.ModuleList(blocks)
        self.head = nn.Linear(WIDTH, 1)
        self.lr = lr
        self.step_losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.layers, nn.Sequential):
            x = self.layers(x)
        else:
            for layer in self.layers:
                x = layer(x)
        return self.head(x).squeeze(-1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.step_losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(7)
        x = torch.randn(64, 8, WIDTH, generator=g)
        y = torch.randn(64, 8, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)


def block_class_path() -> str:
    return f"{Block.__module__}.{Block.__qualname__}"
