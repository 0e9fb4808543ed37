"""A Lightning fit of a tiny ``transformers`` model with activation checkpointing and ``ExactResume``
(run by tests/integration/test_activation_hf_resume.py).

Usage: python hf_job.py CONFIG.json, with keys ``out``, ``ckpt_dir``, ``family`` (llama, gpt2, bert),
``mode`` (full, selective, budget), ``max_steps``, and optionally ``pause_before`` (block at the start of that batch index,
after the checkpoints before it are written, and write ``<out>/paused``) and ``resume`` (a ``ckpt_path``).
It logs one JSON line per step (sample ids and the float bits of the loss) to ``<out>/steps-rank0.jsonl``
and writes the final weights and optimizer state to ``<out>/final.pt``: the files ``tests.helpers.kill_resume``
compares. Checkpoints: every 2 steps, and ``last.ckpt``, in ``ckpt_dir``.
"""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

if __name__ == "__main__":  # run as a script: the repo root holds ``tests``
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from lightning_resume import ExactResume  # noqa: E402
from tests.helpers.hf import HFModule, Tokens, strategy_for  # noqa: E402
from tests.helpers.models import QUIET  # noqa: E402


class StepLog(Callback):
    """One line per trained batch: its sample ids and the loss bits."""

    def __init__(self, out: Path) -> None:
        self.file = open(out / "steps-rank0.jsonl", "a", buffering=1)

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        bits = struct.unpack("<I", struct.pack("<f", outputs["loss"].item()))[0]
        ids = [int(i) for i in batch["id"]]
        self.file.write(json.dumps({"step": trainer.global_step, "ids": ids, "loss": f"{bits:08x}"}) + "\n")


class PauseBefore(Callback):
    """Blocks at the start of batch index ``n`` of this process, so the test can SIGKILL it there."""

    def __init__(self, out: Path, n: int) -> None:
        self.out, self.n, self.seen = out, n, 0

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if self.seen == self.n:
            (self.out / "paused").write_text(str(trainer.global_step))
            while True:
                time.sleep(1)
        self.seen += 1


def main(cfg: dict[str, Any]) -> None:
    out = Path(cfg["out"])
    seed_everything(3, verbose=False)
    module = HFModule(cfg["family"])
    strategy = strategy_for(module, cfg["family"], cfg["mode"])
    seed_everything(4, verbose=False)
    callbacks: list[Callback] = [
        ExactResume(mtbf=None),  # snapshots only where the checkpoint callback saves: the kill point is known
        ModelCheckpoint(dirpath=cfg["ckpt_dir"], every_n_train_steps=2, save_top_k=-1, save_last=True),
        StepLog(out),
    ]
    if cfg.get("pause_before") is not None:
        callbacks.append(PauseBefore(out, cfg["pause_before"]))
    trainer = Trainer(**QUIET, accelerator="cpu", devices=1, strategy=strategy, max_steps=cfg["max_steps"],
                      callbacks=callbacks, num_sanity_val_steps=0)  # fmt: skip
    loader = StatefulDataLoader(Tokens(), batch_size=4, shuffle=True)
    trainer.fit(module, loader, ckpt_path=cfg.get("resume"))
    final = {"model": module.state_dict(), "optimizer": trainer.optimizers[0].state_dict()}
    torch.save(final, out / "final.pt")


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
