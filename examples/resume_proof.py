"""The proof, in Lightning: kill -9 a training run, resume it, and compare every loss bit for bit.

Trains a small model three ways, with the data pipeline as users write it (a ``StatefulDataLoader``
with ``shuffle=True`` and ``num_workers=2``, augmentation noise drawn inside the Dataset, no wrapper),
dropout and AdamW:
  1. uninterrupted;
  2. killed with SIGKILL at step 12 and resumed in a fresh process with ExactResume,
     ``trainer.fit(model, ckpt_path="last")``;
  3. resumed from the same checkpoint's weights only (the common mistake).
It prints the per-step losses side by side and exits non-zero if (2) is not identical to (1) or if
(3) is. Runs on CPU in about 40 s: ``python examples/resume_proof.py``.

``python examples/resume_proof.py --train`` is the training alone, as a user's script is: checkpoints in
``./ckpt``, ``fit(ckpt_path="last")``, so that ``lightning-resume prove -- python examples/resume_proof.py
--train`` proves it from outside.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from lightning_resume import ExactResume  # noqa: E402

MAX_STEPS, KILL_AT, SAVE_EVERY = 30, 12, 5


class Noisy(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 16, generator=g)
        self.y = self.x @ torch.randn(16, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + 0.05 * torch.randn(16), self.y[i]  # augmentation: draws from the global RNG


class Net(pl.LightningModule):
    def __init__(self, log_path: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
        self.log_path = log_path

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        with open(self.log_path, "a") as f:
            f.write(json.dumps({"step": self.global_step, "loss": loss.item()}) + "\n")
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self):
        # The stock pipeline: shuffling, 2 workers, augmentation drawn inside the Dataset, no wrapper.
        return StatefulDataLoader(Noisy(), batch_size=8, shuffle=True, num_workers=2)


class KillAt(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no final save: like a node failure


def child(mode: str, workdir: Path) -> None:
    pl.seed_everything(0)
    ckpt_dir = workdir / ("ckpt-uninterrupted" if mode == "uninterrupted" else "ckpt")
    if mode == "train":  # a user's script: its own ./ckpt, resumed with "last" each time it is launched
        ckpt_dir, mode = Path("ckpt"), "resumed"
    model = Net(str(workdir / f"{mode}.jsonl"))
    callbacks: list[Callback] = [
        ExactResume(),
        ModelCheckpoint(ckpt_dir, every_n_train_steps=SAVE_EVERY, save_last=True),
    ]
    ckpt_path = None
    if mode == "killed":
        callbacks.append(KillAt())
    elif mode == "resumed":
        ckpt_path = "last"
    elif mode == "weights_only":
        state = torch.load(workdir / "at_kill.ckpt", weights_only=True)
        model.load_state_dict(state["state_dict"])
        callbacks = [ModelCheckpoint(workdir / "ckpt-weights-only")]
    steps = MAX_STEPS - (int(state["global_step"]) if mode == "weights_only" else 0)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, ckpt_path=ckpt_path)


def _losses(path: Path, offset: int = 0) -> dict[int, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {r["step"] + offset: r["loss"] for r in rows}


def main() -> int:
    workdir = Path(tempfile.mkdtemp(prefix="resume-proof-"))
    run = lambda mode: subprocess.run(
        [sys.executable, __file__, "--child", mode, "--workdir", str(workdir)],
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
    )
    for mode in ("uninterrupted", "killed", "weights_only", "resumed"):
        proc = run(mode)
        expected = -signal.SIGKILL if mode == "killed" else 0
        if proc.returncode != expected:
            print(f"{mode} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
            return 2
        if mode == "killed":  # what was on disk when the process died
            shutil.copyfile(workdir / "ckpt" / "last.ckpt", workdir / "at_kill.ckpt")
    resumed_from = int(torch.load(workdir / "at_kill.ckpt", weights_only=True)["global_step"])
    a = _losses(workdir / "uninterrupted.jsonl")
    full = {**_losses(workdir / "killed.jsonl"), **_losses(workdir / "resumed.jsonl")}
    weights = {**{s: v for s, v in _losses(workdir / "killed.jsonl").items() if s < KILL_AT}}
    weights.update(_losses(workdir / "weights_only.jsonl", offset=resumed_from))
    return report(a, full, weights, resumed_from)


def report(a: dict[int, float], full: dict[int, float], weights: dict[int, float], resumed_from: int) -> int:
    print(f"killed with SIGKILL at step {KILL_AT}; newest checkpoint: step {resumed_from}\n")
    print(f"{'step':>4}  {'uninterrupted':>14}  {'ExactResume':>14}    {'weights only':>14}")
    after = [s for s in sorted(a) if s >= resumed_from]
    for s in sorted(a):
        mark = lambda d: " " if s < resumed_from else ("=" if d.get(s) == a[s] else "x")
        print(
            f"{s:>4}  {a[s]:>14.10f}  {full.get(s, float('nan')):>14.10f} {mark(full)}  {weights.get(s, float('nan')):>14.10f} {mark(weights)}"
        )
    exact = sum(full.get(s) == a[s] for s in after)
    same_w = sum(weights.get(s) == a[s] for s in after)
    print(f"\nExactResume : {exact}/{len(after)} steps after the resume identical to the uninterrupted run (bitwise)")
    print(f"weights only: {same_w}/{len(after)} steps identical")
    ok = exact == len(after) and same_w < len(after)
    print("PROOF HOLDS" if ok else "PROOF FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=["uninterrupted", "killed", "resumed", "weights_only"])
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--train", action="store_true", help="only train (./ckpt, ckpt_path='last'), for prove")
    args = parser.parse_args()
    if args.train:
        child("train", Path("."))
        sys.exit(0)
    if args.child:
        child(args.child, args.workdir)
        sys.exit(0)
    sys.exit(main())
