"""A Lightning DDP fit under ``torchrun`` (one process per worker); on the first attempt, worker
``kill_rank`` SIGKILLs itself after step ``kill_at``, so torchelastic restarts the group, and every
attempt resumes with ``fit(ckpt_path="last")``.

Usage: torchrun ... elastic_job.py CONFIG.json (the config of ``trainee.py``, plus ``kill_at``,
``kill_rank``, ``nodes``, ``mtbf``). Per-step records go to ``<out>/steps-rank<R>.jsonl`` (appended by
every attempt); each attempt of each rank appends a line to ``<out>/attempts-rank<R>.jsonl`` (its
torchelastic restart count, the step it started from, the schedule's M in seconds and its world size).

For a world size that changes between attempts (``torchrun --nnodes MIN:MAX``): ``elastic`` is passed to
``ExactResume(elastic=...)``; ``world_from_launcher`` takes devices and nodes from torchrun's
``LOCAL_WORLD_SIZE`` and ``WORLD_SIZE`` of this attempt instead of ``devices`` and ``nodes``;
``tag_records`` adds the attempt's ``restart`` count and ``world`` size to every step record;
``use_distributed_sampler`` is the Trainer's (with the trainee's ``pipeline: "plain"``: Lightning's own
sampler over a plain ``DataLoader``); ``max_epochs``, and ``ckpt_every`` (2 by default) with
``ckpt_filename``/``save_top_k`` for ModelCheckpoint; ``pause_at``: every rank blocks at the start of the
batch at that global step, once ``<out>/paused-rank<R>`` is written (its world size and pid), until
``<out>/release`` exists (so a test can kill a node at a known step). Every attempt writes its
``ExactResume.resume_report`` and world size, at train start, to ``<out>/report-rank<R>-attempt<A>.json``
(A: the torchelastic restart count).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
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


class PauseUntilReleased(Callback):
    """Block every rank at the start of the batch at global step ``step`` until ``<out>/release`` exists
    (written by the test); ``<out>/paused-rank<R>`` says this rank is there (its world size and pid). Once
    released, never again."""

    def __init__(self, step: int, out: Path) -> None:
        self.step, self.out = step, out

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        release = self.out / "release"
        if trainer.global_step != self.step or release.exists():
            return
        marker = self.out / f"paused-rank{trainer.global_rank}"
        marker.with_suffix(".tmp").write_text(json.dumps({"world": trainer.world_size, "pid": os.getpid()}))
        marker.with_suffix(".tmp").replace(marker)  # whole when it appears
        while not release.exists():
            time.sleep(0.02)


class WriteReport(Callback):
    """``ExactResume.resume_report`` of this attempt, with its world size, as soon as training starts."""

    def __init__(self, exact: ExactResume, out: Path) -> None:
        self.exact, self.out = exact, out

    def on_train_start(self, trainer: pl.Trainer, *args: object) -> None:  # after ExactResume's (listed first)
        report = {**self.exact.resume_report.to_dict(), "world_size_now": trainer.world_size}
        path = self.out / f"report-rank{trainer.global_rank}-attempt{restart_count()}.json"
        path.write_text(json.dumps(report, default=str))


class TaggedModel(Model):
    """The trainee's model; with ``tag_records``, every step record also names its attempt and world size."""

    def _record(self, **rec: object) -> None:
        if self.cfg.get("tag_records"):
            rec.update(restart=restart_count(), world=self.trainer.world_size)
        super()._record(**rec)


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def main(cfg: dict) -> None:
    torch.set_num_threads(1)
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, workers=True)
    exact = ExactResume(mtbf=cfg.get("mtbf"), elastic=cfg.get("elastic", False))
    checkpoint = ModelCheckpoint(
        dirpath=cfg["ckpt_dir"], every_n_train_steps=cfg.get("ckpt_every", 2), save_last=True,
        save_top_k=cfg.get("save_top_k", 0), filename=cfg.get("ckpt_filename"),
    )  # fmt: skip
    callbacks: list[Callback] = [exact, checkpoint, WriteReport(exact, out)]
    if cfg.get("kill_at") is not None:
        callbacks.append(KillOnce(cfg["kill_at"], cfg.get("kill_rank", 1)))
    if cfg.get("pause_at") is not None:
        callbacks.append(PauseUntilReleased(cfg["pause_at"], out))
    devices, nodes = cfg.get("devices", 2), cfg.get("nodes", 1)
    if cfg.get("world_from_launcher"):  # this attempt's world, as torchrun's rendezvous made it
        devices = int(os.environ["LOCAL_WORLD_SIZE"])
        nodes = int(os.environ["WORLD_SIZE"]) // devices
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=nodes,
        strategy="ddp",
        use_distributed_sampler=cfg.get("use_distributed_sampler", False),
        max_epochs=cfg.get("max_epochs"),
        max_steps=cfg.get("max_steps", -1),
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    model = TaggedModel(dict(cfg, devices=devices * nodes))
    trainer.fit(model, ckpt_path="last")
    attempt = {
        "restart": restart_count(),
        "resumed_from": exact.resume_report.step,
        "mtbf_s": exact.scheduler.state.mtbf_s if exact.scheduler and exact.scheduler.state else None,
        "world_size": trainer.world_size,
    }
    with open(out / f"attempts-rank{trainer.global_rank}.jsonl", "a") as f:
        f.write(json.dumps(attempt) + "\n")
    if trainer.global_rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": trainer.optimizers[0].state_dict()},
                   out / "final.pt")  # fmt: skip
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
