"""One "node" of a two-node Lightning fit on 127.0.0.1 (DDP on gloo, one rank per node, a memory dir per node)
with the replicated memory tier: memory snapshots every step, replicas on the other node.

Usage: replica_fit_job.py DIR PER_NODE [CRASH_STEP], with NODE_RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set (the
processes are started from outside, as torchrun or SLURM start them; PER_NODE ranks on each node). At step ``CHECK_AT``, once this rank's newest snapshot
has been acknowledged by its holder and both ranks got there, each rank compares the replica its node holds with
the other node's own snapshot and writes what it found to ``DIR/check-rank<R>.txt``; then training ends cleanly
(freeing every snapshot and replica),
or, given CRASH_STEP, rank 0 raises at that step (the exception path: replication stops without waiting long).
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
from tests.helpers.callbacks import CrashAt
from tests.helpers.models import QUIET, TinyData, TinyModel
from tests.helpers.replication import wait_replicated

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
        rank, world, (owner,) = trainer.global_rank, trainer.world_size, memory.ring.owners
        replica = Path(memory.store.replica_path(owner))
        node = owner // (world // trainer.num_nodes)
        theirs = (
            Path(memory_root(str(self.out / f"node{node}"))) / memory.store.key / f"rank-{owner}-of-{world}.safetensors"
        )
        same = replica.read_bytes() == theirs.read_bytes()
        (self.out / f"check-rank{rank}.txt").write_text(
            f"replicas {memory.replicas} of {owner} same {same} seq {last.seq} step {last.step} bytes {last.nbytes}"
        )
        trainer.strategy.barrier()


def main(out: Path, per_node: int, crash: int) -> None:
    torch.set_num_threads(1)
    node = int(os.environ["NODE_RANK"])
    pl.seed_everything(0, verbose=False)
    wait_replicated()  # every snapshot replicated (the gate skips one taken while a transfer is busy)
    memory = MemoryTierOptions(dir=str(out / f"node{node}"), every_n_train_steps_max=1)
    exact = ExactResume(schedule=ScheduleOptions(every_n_train_steps_max=100), memory_tier=memory)
    checkpoints = ModelCheckpoint(dirpath=str(out / "ckpt"), every_n_train_steps=100)
    trainer = pl.Trainer(
        **QUIET,
        accelerator="cpu",
        devices=per_node,
        num_nodes=2,
        strategy="ddp",
        max_steps=STEPS,
        limit_val_batches=0,
        callbacks=[exact, CompareReplicas(exact, out), checkpoints, CrashAt(crash, rank=0)],
    )
    trainer.fit(TinyModel(), datamodule=TinyData(n=64))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else -1)
