"""Lightning ``Trainer`` with ``ShardedModelParallelStrategy`` (FSDP2 in ``configure_model``) on 2 CPU processes.

``python tests/helpers/jobs/sharded_lightning_job.py OUT [CKPT_DIR]``: fit to step 4 with ExactResume and a
checkpoint every 2 steps (from CKPT_DIR when given); rank 0 writes OUT/final.pt (full weights, losses).
``--retention``: a ``RetentionCheckpoint`` (keep_last=2) instead of ``ModelCheckpoint``;
``--snapshot-every N``: ExactResume's schedule also snapshots every N steps (through it). ``--async``:
``ShardedModelParallelStrategy(async_save=True)``; ``--fail-write-at N``: rank 1's background write of
step N fails (after DCP's collective write); an error ``fit`` raises is written to OUT/error-<rank>.txt
and the run still dumps its weights.
``shuffle=False``: with ``shuffle=True`` under ``ModelParallelStrategy`` the resumed data order differs
(also with Lightning's own strategy and checkpoints): a data-position issue, not a checkpoint one.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from lightning_resume import ExactResume, RetentionCheckpoint
from lightning_resume.protocols import AsyncCheckpointWriter
from lightning_resume.sharded import background
from lightning_resume.sharded.strategy import ShardedModelParallelStrategy

if __name__ == "__main__":  # run as a script (also by Lightning's launcher): the repo root holds ``tests``
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.helpers.models import QUIET  # after the path is set


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


def fail_background_write(step: int) -> None:
    """Rank 1's background write of step ``step`` fails once DCP's collective write is done."""
    write = background._write_local

    def failing(staging, *rest):
        out = write(staging, *rest)
        if torch.distributed.get_rank() == 1 and f".epoch=0-step={step}.ckpt.partial-" in staging:
            raise OSError(5, "Input/output error (injected)")
        return out

    background._write_local = failing


def main(
    out: str,
    ckpt: str | None,
    retention: bool = False,
    async_save: bool = False,
    fail_at: int = -1,
    snapshot_every: int | None = None,
) -> None:
    torch.set_num_threads(1)
    if fail_at >= 0:
        fail_background_write(fail_at)
    L.seed_everything(7)
    model = Tiny()
    ckpt_dir = os.path.join(out, "ckpt")
    saver = (
        RetentionCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, keep_last=2)
        if retention
        else ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1)
    )
    strategy = ShardedModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, async_save=async_save)
    trainer = L.Trainer(
        **QUIET,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=6,
        callbacks=[ExactResume(mtbf=None, every_n_train_steps_max=snapshot_every), saver],
        default_root_dir=out,
    )
    assert isinstance(trainer.strategy.checkpoint_io, AsyncCheckpointWriter) == async_save
    try:
        trainer.fit(model, ckpt_path=ckpt)
    except Exception as err:
        with open(os.path.join(out, f"error-{trainer.global_rank}.txt"), "w") as handle:
            handle.write(f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
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
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("ckpt", nargs="?")
    p.add_argument("--retention", action="store_true")
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--fail-write-at", type=int, default=-1)
    p.add_argument("--snapshot-every", type=int, default=None, help="ExactResume's every_n_train_steps_max")
    a = p.parse_args()
    main(a.out, a.ckpt, a.retention, a.async_save, a.fail_write_at, a.snapshot_every)
