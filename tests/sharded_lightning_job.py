"""Lightning ``Trainer`` with ``ShardedModelParallelStrategy`` (FSDP2 in ``configure_model``) on 2 CPU processes.

``python tests/sharded_lightning_job.py OUT [CKPT_DIR]``: fit to step 4 with ExactResume and a
checkpoint every 2 steps (from CKPT_DIR when given); rank 0 writes OUT/final.pt (full weights, losses).
``shuffle=False``: with ``shuffle=True`` under ``ModelParallelStrategy`` the resumed data order differs
(also with Lightning's own strategy and checkpoints): a data-position issue, not a checkpoint one.
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from lightning_resume import ExactResume, RetentionCheckpoint
from lightning_resume.sharded.strategy import ShardedModelParallelStrategy


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 1))
        self.losses = []

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
        from torchdata.stateful_dataloader import StatefulDataLoader
        return StatefulDataLoader(data, batch_size=4, shuffle=False)


def main(out: str, ckpt: str | None, retention: bool = False) -> None:
    torch.set_num_threads(1)
    L.seed_everything(7)
    model = Tiny()
    ckpt_dir = os.path.join(out, "ckpt")
    saver = (RetentionCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, keep_last=2) if retention
             else ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ShardedModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=6, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ExactResume(), saver],
        default_root_dir=out,
    )
    trainer.fit(model, ckpt_path=ckpt)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.global_rank == 0:
        torch.save({"model": full, "losses": model.losses}, os.path.join(out, "final.pt"))
    # Close gloo, then skip the interpreter's teardown: gloo's threads abort it now and then (SIGABRT).
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--retention"]
    main(args[0], args[1] if len(args) > 1 else None, retention="--retention" in sys.argv)
