"""A training script for ``lightning-resume prove``, written as users write theirs, with a defect to choose.

Usage: python prove_target.py [--defect NAME] [--devices N] [--max_steps N] [--validate_every N] [--crash_at N]
[--num_nodes N] [--memory_dir DIR] (the memory tier, replicated to the next node when there are several)
[--dedupe] (``SafetensorsCheckpointIO(dedupe=True)``, and a frozen backbone with a trainable adapter, as a
fine-tune with frozen weights is written, so each save after the first references the frozen weight).
It trains a small
model with dropout and AdamW on a plain ``DataLoader(shuffle=True)``, ``ExactResume()`` and a
``ModelCheckpoint`` into ``./ckpt`` (the working directory is the run's own), and relaunched it resumes with
``fit(ckpt_path="last")``. Defects, each a way a resumed run differs that ``prove`` must name:

- ``torch_generator``: noise from a ``torch.Generator`` kept in a module global (no walk from the model reaches
  it; one held on the model is saved) and not registered with ``ExactResume(state=...)``;
- ``numpy_generator``: noise from a ``numpy.random.Generator`` kept in a module global;
- ``loader_subclass``: a ``DataLoader`` subclass, whose position ExactResume cannot take;
- ``buffer``: a non-persistent buffer that training changes (a step counter in the loss);
- ``no_ckpt_path``: ``fit()`` without ``ckpt_path``: every launch starts over.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_resume import ExactResume, MemoryTierOptions, SafetensorsCheckpointIO  # noqa: E402


class Points(Dataset):
    def __init__(self, n: int = 96) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x.sum(1, keepdim=True) > 0).float()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + 0.01 * torch.randn(8), self.y[i]  # augmentation from the global RNG


class MyLoader(DataLoader):
    """A user's DataLoader subclass (e.g. to add a property)."""


NOISE = {"torch": torch.Generator().manual_seed(1), "numpy": np.random.default_rng(1)}
"""Generators in a global, as a script's top level keeps them: no checkpoint saves them."""


class Net(pl.LightningModule):
    def __init__(self, defect: str, frozen: bool = False) -> None:
        super().__init__()
        self.defect = defect
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
        self.register_buffer("seen", torch.zeros(()), persistent=False)
        self.backbone = self.adapter = None
        if frozen:  # a pretrained backbone (128 KiB) kept frozen, and an adapter trained on its features
            self.backbone = nn.Linear(8, 4096).requires_grad_(False)
            self.adapter = nn.Linear(4096, 8)

    def training_step(self, batch, batch_idx):
        time.sleep(0.02)  # a step takes a moment, as real ones do: the kills land while training
        x, y = batch
        if self.backbone is not None and self.adapter is not None:
            x = x + self.adapter(torch.relu(self.backbone(x)))
        if self.defect == "torch_generator":
            x = x + 0.1 * torch.randn(x.shape, generator=NOISE["torch"])
        elif self.defect == "numpy_generator":
            x = x + torch.from_numpy(NOISE["numpy"].normal(size=tuple(x.shape)).astype("float32")) * 0.1
        loss = nn.functional.binary_cross_entropy_with_logits(self.net(x), y)
        if self.defect == "buffer":
            self.seen += 1
            loss = loss * (1 + 1e-3 * self.seen)
        return loss

    def validation_step(self, batch, batch_idx):
        time.sleep(0.02)  # a validation takes a moment too: a kill can land in it
        x, y = batch
        self.log("val_loss", nn.functional.binary_cross_entropy_with_logits(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    def train_dataloader(self):
        cls = MyLoader if self.defect == "loader_subclass" else DataLoader
        return cls(Points(), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(Points(32), batch_size=8)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--defect", default="none")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max_steps", type=int, default=30)
    parser.add_argument("--crash_at", type=int, default=-1)
    parser.add_argument("--validate_every", type=int, default=0, help="validate every N batches (0: never)")
    parser.add_argument("--num_nodes", type=int, default=1, help="torchrun's --nnodes")
    parser.add_argument("--memory_dir", default=None, help="the memory tier on, in this tmpfs, every step")
    parser.add_argument("--dedupe", action="store_true", help="content-addressed saves, a frozen backbone")
    args = parser.parse_args()
    if args.crash_at == 0:
        raise SystemExit("prove_target: crashing on purpose")
    pl.seed_everything(0)
    memory = None if args.memory_dir is None else MemoryTierOptions(dir=args.memory_dir, every_n_train_steps_max=1)
    exact = ExactResume(mtbf=None, memory_tier=memory)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy="ddp" if args.devices > 1 or args.num_nodes > 1 else "auto",
        max_steps=args.max_steps,
        limit_val_batches=2 if args.validate_every else 0,
        val_check_interval=args.validate_every or None,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[exact, ModelCheckpoint(dirpath="ckpt", every_n_train_steps=4, save_last=True)],
        plugins=[SafetensorsCheckpointIO(dedupe=True)] if args.dedupe else None,
    )
    ckpt_path = None if args.defect == "no_ckpt_path" else "last"
    trainer.fit(Net(args.defect, frozen=args.dedupe), ckpt_path=ckpt_path)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
