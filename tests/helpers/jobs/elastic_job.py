"""A Lightning DDP fit under ``torchrun`` (one process per worker); on the first attempt, worker
``kill_rank`` SIGKILLs itself after step ``kill_at``, so torchelastic restarts the group, and every
attempt resumes with ``fit(ckpt_path="last")``.

Usage: torchrun ... elastic_job.py CONFIG.json (the config of ``trainee.py``, plus ``kill_at``,
``kill_rank``, ``nodes``, ``mtbf``). Per-step records go to ``<out>/steps-rank<R>.jsonl`` (appended by
every attempt); each attempt of each rank appends a line to ``<out>/attempts-rank<R>.jsonl`` (its
torchelastic restart count, the step it started from, and the schedule's M in seconds).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root holds ``tests``

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_resume import ExactResume
from tests.helpers.jobs.trainee import Model


class KillOnce(Callback):
    """SIGKILL this worker after step ``step`` on the first attempt only (torchelastic counts restarts)."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main(cfg: dict) -> None:
    torch.set_num_threads(1)
    Path(cfg["out"]).mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, workers=True)
    exact = ExactResume(mtbf=cfg.get("mtbf"))
    callbacks: list[Callback] = [
        exact,
        ModelCheckpoint(dirpath=cfg["ckpt_dir"], every_n_train_steps=2, save_last=True, save_top_k=0),
    ]
    if cfg.get("kill_at") is not None:
        callbacks.append(KillOnce(cfg["kill_at"], cfg.get("kill_rank", 1)))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=cfg.get("devices", 2),
        num_nodes=cfg.get("nodes", 1),
        strategy="ddp",
        use_distributed_sampler=False,
        max_steps=cfg["max_steps"],
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    model = Model(dict(cfg, devices=cfg.get("devices", 2) * cfg.get("nodes", 1)))
    trainer.fit(model, ckpt_path="last")
    attempt = {
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "resumed_from": (exact.resume_report or {}).get("step"),
        "mtbf_s": exact.scheduler.state.mtbf_s if exact.scheduler and exact.scheduler.state else None,
    }
    with open(Path(cfg["out"]) / f"attempts-rank{trainer.global_rank}.jsonl", "a") as f:
        f.write(json.dumps(attempt) + "\n")
    if trainer.global_rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": trainer.optimizers[0].state_dict()},
                   Path(cfg["out"]) / "final.pt")  # fmt: skip
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
