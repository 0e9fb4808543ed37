"""Small LightningModules, modules and data shared by several test modules and by the subprocess jobs
(importable by subprocesses and by LightningCLI YAML class paths as ``tests.helpers.models.<Name>``).

Tests that compare results bit for bit depend on these exact definitions and seeds: change one only
together with every test that uses it.
"""

from __future__ import annotations

import lightning
import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# --------------------------------------------------------------------------- retention (and exact CLI)


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
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        limit_val_batches=2,
        num_sanity_val_steps=0,
    )
    options.update(kwargs)
    return Trainer(callbacks=callbacks, **options)


def tiny_fit(callback, ckpt_path=None, **trainer_kwargs) -> Trainer:
    """Seeded fit of ``TinyModel`` on ``TinyData`` with one callback (3 epochs of 4 batches by default)."""
    lightning.seed_everything(0, verbose=False)
    options = dict(max_epochs=3, limit_train_batches=4)
    options.update(trainer_kwargs)
    trainer = tiny_trainer([callback], **options)
    trainer.fit(TinyModel(), datamodule=TinyData(), ckpt_path=ckpt_path)
    return trainer


# --------------------------------------------------------------------------- io plugin (and legacy CLI)


class TinyWithScheduler(LightningModule):
    """MLP regressor with AdamW and a per-epoch StepLR; ``lr`` is a saved hyperparameter."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, 4, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=False)


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


def checkpointed_modules(root: nn.Module) -> list[str]:
    """Qualified names of the modules whose forward lightning-resume replaced (activation checkpointing)."""
    from lightning_resume.activation.apply import _MARK

    return [name for name, m in root.named_modules() if m.__dict__.get(_MARK, False)]
