"""Sharded (FSDP2) training that resumes from the newest committed checkpoint, on CPU or GPU.

python examples/distributed_resume.py --root ckpt            # Lightning starts 2 processes
torchrun --nproc-per-node 2 examples/distributed_resume.py --root ckpt
# kill it at any moment (kill -9), run the same command again: it continues from the newest
# committed checkpoint; a save that was cut short is never picked and is cleaned up, and a save
# over an existing name (save_last) replaces it only once the new directory is committed.
lightning-resume consolidate ckpt/step=000008.ckpt full.safetensors
lightning-resume export ckpt/step=000008.ckpt weights.safetensors --dtype bf16
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.fsdp import fully_shard
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_resume import ExactResume, ShardedModelParallelStrategy, newest_committed


class Regressor(L.LightningModule):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Dropout(0.1), nn.Linear(width, 1))

    def configure_model(self) -> None:  # shard every Linear, then the root, over the data-parallel mesh
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(512, 16, generator=g), torch.randn(512, 1, generator=g))
        return StatefulDataLoader(data, batch_size=8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default="ckpt")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="auto",
        devices=args.devices,
        max_steps=args.steps,
        strategy=ShardedModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1),
        callbacks=[
            ExactResume(),
            ModelCheckpoint(dirpath=args.root, filename="{step:06d}", every_n_train_steps=8, save_top_k=-1),
        ],
        logger=False,
        enable_progress_bar=False,
    )
    # newest *committed and verified* directory, or None (fresh start). Each rank computes it; the
    # strategy then broadcasts rank 0's path.
    trainer.fit(Regressor(), ckpt_path=newest_committed(args.root))
    if torch.distributed.is_initialized():  # close gloo before exit: its threads otherwise may abort the process
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
