"""The tests' small models and trainers, shared by test modules and by the subprocess jobs (importable by
subprocesses and by LightningCLI YAML class paths as ``tests.helpers.models.<Name>``).

One family of tiny regressors (``TinyRegressor``: MSE, ``train_loss`` logged, ``step_losses`` kept):
``TinyModel`` (linear, SGD, with ``TinyData``; logs ``val/loss`` for monitor tests), ``TinyMLP`` (an MLP
with its own data, AdamW, optionally a StepLR) and its preset ``TinyWithScheduler``, and ``Stack`` (residual
``Block``s, for activation checkpointing); plus ``QUIET``/``TINY_TRAINER``, the trainer options every test
fit shares, in process or in a job.

Tests that compare results bit for bit depend on these exact definitions and seeds: change one only
together with every test that uses it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as lightning
import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.plugins import CheckpointIO
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

QUIET: dict[str, Any] = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
"""No logger, progress bar or model summary: the options of every test trainer, in process or in a job."""

TINY_TRAINER: dict[str, Any] = {
    **QUIET,
    "accelerator": "cpu",
    "devices": 1,
    "limit_val_batches": 2,
    "num_sanity_val_steps": 0,
}
"""``QUIET`` on one CPU process, two validation batches, no sanity check (also for LightningCLI YAML)."""


def sum_data(n: int, noise: float = 0.0) -> TensorDataset:
    """``n`` seeded samples of 4 features, the target their sum (plus ``noise`` times seeded noise)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = x.sum(1, keepdim=True)
    return TensorDataset(x, y + noise * torch.randn(n, 1, generator=g) if noise else y)


class TinyRegressor(LightningModule):
    """The family's base: ``forward`` (``net`` unless overridden) predicts a batch's ``y`` from its ``x``
    under MSE; each step's loss is logged as ``train_loss`` and kept in ``step_losses`` (for bitwise checks)."""

    net: nn.Module

    def __init__(self) -> None:
        super().__init__()
        self.step_losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        self.step_losses.append(loss.detach().clone())
        return loss


# --------------------------------------------------------------------------- retention, exact resume, CLI


class TinyModel(TinyRegressor):
    """A linear regressor with SGD that logs ``val/loss`` (for monitor tests); its data is ``TinyData``."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Linear(4, 1)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class TinyData(LightningDataModule):
    """``sum_data(n, noise=0.1)`` for training and validation alike."""

    def __init__(self, n: int = 32, batch_size: int = 4) -> None:
        super().__init__()
        self.data = sum_data(n, noise=0.1)
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)


def tiny_trainer(callbacks: list[Callback], **kwargs: Any) -> Trainer:
    """A ``TINY_TRAINER`` with ``callbacks``; ``kwargs`` override or add options."""
    return Trainer(callbacks=callbacks, **{**TINY_TRAINER, **kwargs})


def tiny_fit(callback: Callback, ckpt_path: Optional[str] = None, **trainer_kwargs: Any) -> Trainer:
    """Seeded fit of ``TinyModel`` on ``TinyData`` with one callback (3 epochs of 4 batches by default)."""
    lightning.seed_everything(0, verbose=False)
    trainer = tiny_trainer([callback], **{"max_epochs": 3, "limit_train_batches": 4, **trainer_kwargs})
    trainer.fit(TinyModel(), datamodule=TinyData(), ckpt_path=ckpt_path)
    return trainer


# --------------------------------------------------------------------------- checkpoint io


class TinyMLP(TinyRegressor):
    """A Tanh MLP (4 -> ``hidden`` -> 1) on ``sum_data(n)`` in batches of 4, trained with AdamW;
    ``scheduler=True`` adds a per-epoch StepLR halving the rate."""

    def __init__(self, lr: float = 0.05, hidden: int = 16, n: int = 64, scheduler: bool = False) -> None:
        super().__init__()
        self.lr, self.n, self.scheduler = lr, n, scheduler
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        if not self.scheduler:
            return opt
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}

    def train_dataloader(self):
        return DataLoader(sum_data(self.n), batch_size=4, shuffle=False)


class TinyWithScheduler(TinyMLP):
    """``TinyMLP(hidden=8, n=32, scheduler=True)`` whose ``lr`` is a saved hyperparameter."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__(lr, hidden=8, n=32, scheduler=True)
        self.save_hyperparameters()


def io_trainer(root: Union[str, Path], max_steps: int, callbacks: list[Callback], io: CheckpointIO) -> Trainer:
    """A ``TINY_TRAINER`` in ``root`` that saves through ``io``, for ``max_steps`` steps."""
    return tiny_trainer(callbacks, default_root_dir=str(root), max_steps=max_steps, plugins=[io])


# --------------------------------------------------------------------------- activation checkpointing

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


class Stack(TinyRegressor):
    """A stack of Blocks in an ``nn.Sequential`` (``sequential=True``) or an ``nn.ModuleList``, then a linear head."""

    def __init__(self, n_blocks: int = 4, sequential: bool = True, lr: float = 0.05) -> None:
        super().__init__()
        blocks = [Block() for _ in range(n_blocks)]
        self.layers = nn.Sequential(*blocks) if sequential else nn.ModuleList(blocks)
        self.head = nn.Linear(WIDTH, 1)
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.layers, nn.Sequential):
            x = self.layers(x)
        else:
            for layer in self.layers:
                x = layer(x)
        return self.head(x).squeeze(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(7)
        x = torch.randn(64, 8, WIDTH, generator=g)
        y = torch.randn(64, 8, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)


def block_class_path() -> str:
    return f"{Block.__module__}.{Block.__qualname__}"


def checkpointed_modules(root: nn.Module) -> list[str]:
    """Qualified names of the modules whose forward lightning-resume replaced (activation checkpointing)."""
    from lightning_resume.activation.apply import _MARK

    return [name for name, m in root.named_modules() if m.__dict__.get(_MARK, False)]
