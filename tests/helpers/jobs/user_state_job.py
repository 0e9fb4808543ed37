"""The trainee (``trainee.py``) with a model that keeps state outside Lightning's lists, the way public
Lightning code keeps it; ``cfg["user_state"]`` picks the pattern:

- ``"scheduler"``: an LR scheduler kept as ``self.lr_scheduler`` and stepped by hand in ``optimizer_step``
  (Lightning's UvA-DL tutorials, ``CosineWarmupScheduler``);
- ``"metrics"``: torchmetrics ``MeanMetric``, ``BinaryAccuracy``, ``MaxMetric`` and a ``MetricCollection``
  logged with ``on_epoch=True`` (lightning-hydra-template, which also resets its validation metrics in
  ``on_train_start``), monitored by the trainee's ``monitor_ckpt``;
- ``"env"``: a gym-style environment object with its own ``np_random`` (``numpy.random.Generator``) and a
  ``random.Random``, drawn from at every step;
- ``"replay"``: an ``IterableDataset`` sampling a replay buffer the module fills at every step, written the
  way docs/exact-resume.md documents (Lightning's DQN example, made resumable);
- ``"registered"``: a NumPy generator the dataset reaches through a module global, registered with
  ``ExactResume(state={"augment": ...})``.

Every step record adds the learning rate and ``trainer.callback_metrics`` (epoch-level values once the
epoch ended) as float bits, so the kill-and-resume tests compare them with the losses.
Usage: python user_state_job.py CONFIG.json (the trainee's config, plus ``user_state``).
"""

from __future__ import annotations

import json
import math
import random
import sys
from collections import deque
from pathlib import Path

import numpy as np
import torch
from torch import nn, optim
from torch.utils.data import IterableDataset

if __name__ == "__main__":  # run as a script: the repo root holds ``tests``
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from torchmetrics import MaxMetric, MeanMetric, Metric, MetricCollection
from torchmetrics.classification import BinaryAccuracy, BinaryPrecision

from lightning_resume.exact.state.fingerprint import digest
from tests.helpers.jobs import trainee
from tests.helpers.jobs.trainee import DIM, Model, Points, StatefulDataLoader, loss_bits


def _bits(value) -> str:
    return loss_bits(torch.as_tensor(value))


class Recorded(Model):
    """The trainee's model, recording learning rate and logged metrics with every step."""

    def _record_step(self, batch_ids, loss) -> None:
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        metrics = {k: _bits(v) for k, v in sorted(self.trainer.callback_metrics.items())}
        held = {n: digest([m.metric_state, m.update_count]) for n, m in self.named_modules() if isinstance(m, Metric)}
        self._record(
            epoch=self.current_epoch, step=self.global_step, ids=batch_ids, loss=loss_bits(loss), lr=lr, m=metrics,
            states=held,
        )  # fmt: skip

    def on_train_end(self) -> None:
        self._record(final_metrics={k: _bits(v) for k, v in sorted(self.trainer.callback_metrics.items())})


# ---------------------------------------------------------------------------------- "scheduler"


class CosineWarmupScheduler(optim.lr_scheduler.LRScheduler):
    """As in Lightning's UvA-DL tutorial 5 (Transformers and multi-head attention)."""

    def __init__(self, optimizer, warmup, max_iters):
        self.warmup = warmup
        self.max_num_iters = max_iters
        super().__init__(optimizer)

    def get_lr(self):
        lr_factor = self.get_lr_factor(epoch=self.last_epoch)
        return [base_lr * lr_factor for base_lr in self.base_lrs]

    def get_lr_factor(self, epoch):
        # the tutorial's np.cos makes every LR a numpy.float64, in the optimizer state too: a pickled global that
        # torch.load(weights_only=True) refuses (issue 39, item 6, which is not this job's): math.cos here
        lr_factor = 0.5 * (1 + math.cos(math.pi * epoch / self.max_num_iters))
        if epoch <= self.warmup:
            lr_factor *= epoch * 1.0 / self.warmup
        return lr_factor


class HandSteppedScheduler(Recorded):
    def training_step(self, batch, batch_idx):
        loss = nn.functional.binary_cross_entropy_with_logits(self.net(batch["x"]), batch["y"])
        self._record_step([int(i) for i in batch["id"]], loss)
        return loss

    def configure_optimizers(self):
        optimizer = optim.Adam(self.parameters(), lr=1e-2)
        self.lr_scheduler = CosineWarmupScheduler(optimizer, warmup=5, max_iters=60)
        return optimizer

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        self.lr_scheduler.step()  # Step per iteration


# ------------------------------------------------------------------------------------ "metrics"


class WithMetrics(Recorded):
    def __init__(self, cfg: dict) -> None:
        super().__init__(cfg)
        self.train_loss = MeanMetric()
        self.train_acc = BinaryAccuracy()
        self.val_acc = BinaryAccuracy()
        self.val_acc_best = MaxMetric()
        self.train_metrics = MetricCollection({"precision": BinaryPrecision(), "acc": BinaryAccuracy()}, prefix="tm/")

    def on_train_start(self) -> None:
        # lightning-hydra-template: "make sure validation metrics don't store results from these checks"
        self.val_acc.reset()
        self.val_acc_best.reset()

    def training_step(self, batch, batch_idx):
        logits = self.net(batch["x"])
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch["y"])
        self.train_loss(loss)
        self.train_acc(logits.sigmoid(), batch["y"])
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        self.train_metrics.update(logits.sigmoid(), batch["y"])
        # the collection itself, not the dict of tensors its forward returns: Lightning averages logged tensors
        # over the epoch in a state no checkpoint holds (docs/exact-resume.md, "What cannot be exact")
        self.log_dict(self.train_metrics, on_step=False, on_epoch=True)
        self._record_step([int(i) for i in batch["id"]], loss)
        return loss

    def validation_step(self, batch, batch_idx):
        logits = self.net(batch["x"])
        self.val_acc(logits.sigmoid(), batch["y"])
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True)

    def on_validation_epoch_end(self) -> None:
        self.val_acc_best(self.val_acc.compute())
        self.log("val/acc_best", self.val_acc_best.compute())


# ---------------------------------------------------------------------------------------- "env"


class NoisyEnv:
    """A gym-style environment: its own ``np_random``, and a ``random.Random`` for its episode lengths."""

    def __init__(self, seed: int) -> None:
        self.np_random = np.random.default_rng(seed)
        self.py_random = random.Random(seed)

    def observe(self, x: torch.Tensor) -> torch.Tensor:
        noise = self.np_random.normal(size=tuple(x.shape)).astype(np.float32)
        return x + 0.1 * torch.from_numpy(noise) * self.py_random.random()


class WithEnv(Recorded):
    def __init__(self, cfg: dict) -> None:
        super().__init__(cfg)
        self.env = NoisyEnv(seed=3)

    def training_step(self, batch, batch_idx):
        x = self.env.observe(batch["x"])
        loss = nn.functional.binary_cross_entropy_with_logits(self.net(x), batch["y"])
        self._record_step([int(i) for i in batch["id"]], loss)
        return loss


# ------------------------------------------------------------------------------------- "replay"


class ReplayBuffer:
    """Transitions the module appends at every step; its whole content is its state."""

    def __init__(self, capacity: int) -> None:
        self.buffer: deque = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self.buffer)

    def append(self, obs: np.ndarray, reward: float) -> None:
        self.buffer.append((obs, reward))

    def state_dict(self) -> dict:
        obs = np.stack([o for o, _ in self.buffer]) if self.buffer else np.zeros((0, DIM), np.float32)
        return {"obs": torch.from_numpy(obs), "reward": torch.tensor([r for _, r in self.buffer])}

    def load_state_dict(self, state: dict) -> None:
        self.buffer.clear()
        self.buffer.extend(zip(state["obs"].numpy(), state["reward"].tolist()))


class ToyEnv:
    """An environment whose observation moves with every action: state of its own, a ``state_dict`` for it."""

    def __init__(self, seed: int) -> None:
        self.np_random = np.random.default_rng(seed)
        self.obs = self.np_random.normal(size=DIM).astype(np.float32)

    def step(self, action: float) -> tuple[np.ndarray, float]:
        reward = float(np.tanh(self.obs.sum()) * action)
        self.obs = (0.9 * self.obs + self.np_random.normal(size=DIM)).astype(np.float32)
        return self.obs, reward

    def state_dict(self) -> dict:
        return {"obs": self.obs, "rng": self.np_random.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.obs = state["obs"]
        self.np_random.bit_generator.state = state["rng"]


class ReplayDataset(IterableDataset):
    """Samples the buffer, ``samples`` per epoch; its own iterator, so its position is its ``state_dict``."""

    def __init__(self, buffer: ReplayBuffer, samples: int, seed: int) -> None:
        self.buffer, self.samples = buffer, samples
        self.rng = np.random.default_rng(seed)
        self.i = 0

    def __iter__(self):
        self.i = 0
        return self

    def __next__(self):
        if self.i >= self.samples:
            raise StopIteration
        self.i += 1
        obs, reward = self.buffer.buffer[int(self.rng.integers(len(self.buffer)))]
        return {"id": self.i, "x": torch.from_numpy(obs), "y": torch.tensor([float(reward > 0)])}

    def state_dict(self) -> dict:
        return {"i": self.i, "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.i = state["i"]
        self.rng.bit_generator.state = state["rng"]


class WithReplay(Recorded):
    def __init__(self, cfg: dict) -> None:
        super().__init__(cfg)
        self.env = ToyEnv(seed=5)
        self.buffer = ReplayBuffer(capacity=64)
        for _ in range(16):  # warm start, as Lightning's DQN example fills its buffer before training
            self.buffer.append(*self.env.step(1.0))

    def training_step(self, batch, batch_idx):
        loss = nn.functional.binary_cross_entropy_with_logits(self.net(batch["x"]), batch["y"])
        with torch.no_grad():  # act: the buffer grows with what the current network does
            action = float(torch.tanh(self.net(torch.from_numpy(self.env.obs)[None])).item())
        self.buffer.append(*self.env.step(action))
        self._record_step([int(i) for i in batch["id"]], loss)
        return loss

    def train_dataloader(self):
        dataset = ReplayDataset(self.buffer, samples=self.cfg.get("n", 40), seed=11)
        return StatefulDataLoader(dataset, batch_size=self.cfg.get("batch_size", 4))


# ---------------------------------------------------------------------------------- "registered"

AUGMENT = np.random.default_rng(21)
"""A generator the walk cannot see: the dataset reaches it through this module's globals."""


class GlobalNoisePoints(Points):
    def __getitem__(self, i: int):
        item = super().__getitem__(i)
        return dict(item, x=item["x"] + torch.from_numpy(AUGMENT.normal(size=DIM).astype(np.float32)))


class WithRegistered(Recorded):
    def training_step(self, batch, batch_idx):
        loss = nn.functional.binary_cross_entropy_with_logits(self.net(batch["x"]), batch["y"])
        self._record_step([int(i) for i in batch["id"]], loss)
        return loss

    def train_dataloader(self):
        return self._loader(GlobalNoisePoints(self.cfg.get("n", 40), False), shuffle=True)


class RegisteringExactResume(trainee.ExactResume):
    def __init__(self, **kwargs) -> None:
        super().__init__(state={"augment": AUGMENT}, **kwargs)


MODELS = {
    "scheduler": HandSteppedScheduler,
    "metrics": WithMetrics,
    "env": WithEnv,
    "replay": WithReplay,
    "registered": WithRegistered,
}


def main(cfg: dict) -> None:
    trainee.Model = MODELS[cfg["user_state"]]  # the trainee's run, with this model
    if not cfg.get("capture_user_state", True):  # the control: ExactResume as it was, finding nothing
        from lightning_resume.exact import callback
        from lightning_resume.exact.state.user import UserState

        callback.find_in_fit = lambda *args: UserState()
    if cfg["user_state"] == "registered" and cfg.get("register", True):
        trainee.ExactResume = RegisteringExactResume
    trainee.main(cfg)


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
