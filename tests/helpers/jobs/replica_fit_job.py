"""One "node" of a two-node Lightning fit on 127.0.0.1 (DDP on gloo, one rank per node, a memory dir per node)
with the replicated memory tier: memory snapshots every step, replicas on the other node.

Usage: replica_fit_job.py DIR, with NODE_RANK, LOCAL_RANK=0, MASTER_ADDR, MASTER_PORT set (the processes are
started from outside, as torchrun or SLURM start them). At step ``CHECK_AT``, once this rank's newest snapshot
has been acknowledged by its holder and both ranks got there, each rank compares the replica its node holds with
the other node's own snapshot and writes what it found to ``DIR/check-rank<R>.txt``; then training ends cleanly.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root holds ``tests``

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_resume import ExactResume, MemoryTierOptions, ScheduleOptions
from lightning_resume.memory.store import memory_root
from tests.helpers.models import QUIET, TinyData, TinyModel

CHECK_AT, STEPS = 4, 6


class CompareReplicas(Callback):
    """At step ``CHECK_AT``: this node's replica of the other rank, byte for byte that rank's own snapshot?"""

    def __init__(self, exact: ExactResume, out: Path) -> None:
        self.exact, self.out = exact, out

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != CHECK_AT:
            return
        memory = self.exact.memory
        assert memory is not None and memory.store is not None and memory.replicator is not None
        memory.store.wait()
        deadline = time.monotonic() + 120
        while (last := memory.replicator.last_transfer) is None or last.seq != memory.seq:
            assert time.monotonic() < deadline, "the newest snapshot was never acknowledged by its holder"
            time.sleep(0.01)
        trainer.strategy.barrier()  # both replicas written; no rank snapshots again before the next barrier
        rank, other = trainer.global_rank, 1 - trainer.global_rank
        replica = Path(memory.store.replica_path(other))
        theirs = Path(memory_root(str(self.out / f"node{other}"))) / memory.store.key / f"rank-{other}-of-2.safetensors"
        same = replica.read_bytes() == theirs.read_bytes()
        (self.out / f"check-rank{rank}.txt").write_text(
            f"replicas {memory.replicas} same {same} seq {last.seq} step {last.step} bytes {last.nbytes}"
        )
        trainer.strategy.barrier()


def main(out: Path) -> None:
    torch.set_num_threads(1)
    node = int(os.environ["NODE_RANK"])
    pl.seed_everything(0, verbose=False)
    memory = MemoryTierOptions(dir=str(out / f"node{node}"), every_n_train_steps_max=1)
    exact = ExactResume(schedule=ScheduleOptions(every_n_train_steps_max=100), memory_tier=memory)
    checkpoints = ModelCheckpoint(dirpath=str(out / "ckpt"), every_n_train_steps=100)
    trainer = pl.Trainer(
        **QUIET,
        accelerator="cpu",
        devices=1,
        num_nodes=2,
        strategy="ddp",
        max_steps=STEPS,
        limit_val_batches=0,
        callbacks=[exact, CompareReplicas(exact, out), checkpoints],
    )
    trainer.fit(TinyModel(), datamodule=TinyData(n=64))
    left = sorted(p.name for p in (out / f"node{node}").rglob("*") if p.is_file())
    (out / f"end-rank{trainer.global_rank}.txt").write_text(f"left {left}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
