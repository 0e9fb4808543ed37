"""Lightning ``Trainer`` with ``ShardedModelParallelStrategy`` (FSDP2 in ``configure_model``) on CPU processes.

``python tests/helpers/jobs/sharded_lightning_job.py OUT [CKPT_DIR]``: fit to step 4 with ExactResume and a
checkpoint every 2 steps (from CKPT_DIR when given); rank 0 writes OUT/final.pt (full weights, losses).
``--retention``: a ``RetentionCheckpoint`` (``RetentionPolicy(keep_last=2)``) instead of ``ModelCheckpoint``;
``--snapshot-every N``: ExactResume's schedule also snapshots every N steps (through it). ``--async``:
``ShardedModelParallelStrategy(save="async")``; ``--fail-write-at N``: rank 1's background write of
step N fails (after DCP's collective write); an error ``fit`` raises is written to OUT/error-<rank>.txt
and the run still dumps its weights.
``shuffle=False`` by default: with ``shuffle=True`` under ``ModelParallelStrategy`` the resumed data order
differs (also with Lightning's own strategy and checkpoints): a data-position issue, not a checkpoint one.

For the elastic tests (every default above unchanged without them): ``--devices N`` (data_parallel_size),
``--elastic`` (``ExactResume(elastic=True)``), ``--shuffle``, ``--samples N``, ``--plain-loader`` (a torch
``DataLoader``, which ExactResume adopts, instead of torchdata's), ``--num-workers N``, ``--max-epochs N``
(instead of ``max_steps``), ``--every N`` (checkpoint interval), ``--pause-before K`` (block at batch K
after writing OUT/paused, for the test to SIGKILL the process group) and ``--dump-start`` (rank 0 writes
the full weights as training starts, after the restore resharded them, to OUT/start.pt); ``--ckpt-dir URL``
checkpoints there instead of OUT/ckpt. Every sample
carries its id: each rank appends one line per step (epoch, global step, ids) to OUT/steps-rank<R>.jsonl,
and a resumed run writes ``ExactResume.resume_report`` to OUT/report-rank<R>.json.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from lightning_resume import ExactResume, RetentionCheckpoint, RetentionPolicy
from lightning_resume.io.sharded_strategy import ShardedModelParallelStrategy
from lightning_resume.protocols import AsyncCheckpointWriter
from lightning_resume.sharded import background

if __name__ == "__main__":  # run as a script (also by Lightning's launcher): the repo root holds ``tests``
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from lightning_resume import ScheduleOptions
from tests.helpers.jobs.trainee import PauseBefore  # after the path is set
from tests.helpers.models import QUIET


class Tiny(L.LightningModule):
    def __init__(self, samples: int = 64, shuffle: bool = False, plain: bool = False, workers: int = 0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 1))
        self.losses = []
        self.samples, self.shuffle, self.plain, self.workers = samples, shuffle, plain, workers
        self.records: Optional[Any] = None

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch, _):
        x, y, ids = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        self._record(epoch=self.current_epoch, step=self.global_step, ids=[int(i) for i in ids])
        return loss

    def _record(self, **record: Any) -> None:
        """One line of OUT/steps-rank<R>.jsonl, flushed at once: a SIGKILL loses none."""
        if self.records is None:
            out = Path(self.trainer.default_root_dir)
            self.records = open(out / f"steps-rank{self.global_rank}.jsonl", "a", buffering=1)
        self.records.write(json.dumps(record) + "\n")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        n = self.samples
        x, y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)
        data = torch.utils.data.TensorDataset(x, y, torch.arange(n))
        from torchdata.stateful_dataloader import StatefulDataLoader

        cls = torch.utils.data.DataLoader if self.plain else StatefulDataLoader
        return cls(data, batch_size=4, shuffle=self.shuffle, num_workers=self.workers)


class DumpStart(Callback):
    """Rank 0 writes OUT/start.pt: the full weights at the start of training, i.e. as the restore resharded them
    (gathering them is a collective: every rank calls it)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        full = get_model_state_dict(pl_module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if trainer.global_rank == 0:
            torch.save(full, self.out / "start.pt")


def fail_background_write(step: int) -> None:
    """Rank 1's background write of step ``step`` fails once DCP's collective write is done."""
    write = background._write_local

    def failing(staging, *rest):
        out = write(staging, *rest)
        if torch.distributed.get_rank() == 1 and f".epoch=0-step={step}.ckpt.partial-" in staging:
            raise OSError(5, "Input/output error (injected)")
        return out

    background._write_local = failing


def main(a: Any) -> None:
    torch.set_num_threads(1)
    if a.fail_write_at >= 0:
        fail_background_write(a.fail_write_at)
    out = a.out
    Path(out).mkdir(parents=True, exist_ok=True)
    L.seed_everything(7)
    model = Tiny(a.samples, a.shuffle, a.plain_loader, a.num_workers)
    ckpt_dir = a.ckpt_dir or os.path.join(out, "ckpt")
    saver = (
        RetentionCheckpoint(dirpath=ckpt_dir, every_n_train_steps=a.every, retention=RetentionPolicy(keep_last=2))
        if a.retention
        else ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=a.every, save_top_k=-1)
    )
    exact = ExactResume(
        mtbf=None, schedule=ScheduleOptions(every_n_train_steps_max=a.snapshot_every), elastic=a.elastic
    )
    callbacks: list[Callback] = [exact, saver]
    if a.dump_start:
        callbacks.append(DumpStart(Path(out)))
    if a.pause_before is not None:
        callbacks.append(PauseBefore(Path(out), a.pause_before))
    strategy = ShardedModelParallelStrategy(data_parallel_size=a.devices, tensor_parallel_size=1, save=a.save)
    trainer = L.Trainer(
        **QUIET,
        accelerator="cpu",
        devices=a.devices,
        strategy=strategy,
        max_steps=6 if a.max_epochs is None else -1,
        max_epochs=a.max_epochs,
        callbacks=callbacks,
        default_root_dir=out,
    )
    assert isinstance(trainer.strategy.checkpoint_io, AsyncCheckpointWriter) == (a.save == "async")
    try:
        trainer.fit(model, ckpt_path=a.ckpt)
    except Exception as err:
        with open(os.path.join(out, f"error-{trainer.global_rank}.txt"), "w") as handle:
            handle.write(f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
    # What the resume said it did: OUT/report-rank<R>.json
    with open(os.path.join(out, f"report-rank{trainer.global_rank}.json"), "w") as handle:
        json.dump(exact.resume_report.to_dict(), handle, default=str)
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
    p.add_argument("--async", dest="save", action="store_const", const="async", default="sync")
    p.add_argument("--fail-write-at", type=int, default=-1)
    p.add_argument("--snapshot-every", type=int, default=None, help="ExactResume's every_n_train_steps_max")
    p.add_argument("--devices", type=int, default=2, help="processes, all data parallel")
    p.add_argument("--elastic", action="store_true", help="ExactResume(elastic=True)")
    p.add_argument("--shuffle", action="store_true")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--plain-loader", action="store_true", help="torch's DataLoader instead of torchdata's")
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--max-epochs", type=int, default=None, help="instead of max_steps=6")
    p.add_argument("--every", type=int, default=2, help="checkpoint every N training steps")
    p.add_argument("--pause-before", type=int, default=None, help="block at this batch after writing OUT/paused")
    p.add_argument("--dump-start", action="store_true", help="rank 0 writes OUT/start.pt at on_train_start")
    p.add_argument("--ckpt-dir", help="checkpoint directory (a URL) instead of OUT/ckpt")
    main(p.parse_args())
