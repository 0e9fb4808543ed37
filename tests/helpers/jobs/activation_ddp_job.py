"""Two-process gloo DDP fit, with or without activation checkpointing (run by tests/integration/test_activation_ddp.py).

Usage: python tests/helpers/jobs/activation_ddp_job.py OUT.pt on|off
Rank 0 writes its per-step losses, final weights and checkpointed module names to OUT.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.strategies import DDPStrategy

from lightning_resume import ActivationCheckpointingDDPStrategy

if __name__ == "__main__":  # run as a script (also by Lightning's DDP launcher): the repo root holds ``tests``
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.helpers.models import QUIET, Block, Stack, checkpointed_modules  # after the path is set


def main(out: str, mode: str) -> None:
    torch.set_num_threads(1)
    seed_everything(5)
    model = Stack(n_blocks=4)
    strategy = ActivationCheckpointingDDPStrategy(blocks=Block, select="sqrt") if mode == "on" else DDPStrategy()
    trainer = Trainer(**QUIET, accelerator="cpu", devices=2, strategy=strategy, max_steps=4, enable_checkpointing=False)
    trainer.fit(model)
    if trainer.global_rank == 0:
        torch.save(
            {
                "losses": torch.stack(model.step_losses),
                "state": model.state_dict(),
                "checkpointed": checkpointed_modules(model),
            },
            out,
        )
    if torch.distributed.is_initialized():  # close gloo before exit: its threads may otherwise abort the process
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # gloo's threads still abort the interpreter's teardown now and then (SIGABRT, "terminate called without an
    # active exception": CI of 2026-12-02); nothing is left to tear down
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
