"""Time a save costs a Lightning fit, as users run it: ``ExactResume`` + ``ModelCheckpoint`` + a CheckpointIO.

One process. A Lightning fit of an MLP whose fp32 weights are ``--params-mb`` (AdamW: three times that in
state) on CPU, one thread, saving every ``--every`` steps. Each step's wall time is taken from one batch
start to the next; "time lost per save" is the sum, over the step that saved and the ``--window - 1``
steps after it, of (step time - the median step time of the same fit's steps outside any save window),
and is reported as a ratio to a memcpy of the state's bytes measured in the same process just before
each fit (``ctypes.memmove`` into preallocated, touched buffers: the least any snapshot can block).
The first save of each fit is left out (its staging memory is new). Median and spread over the saves of
``--repeats`` fits per configuration, configurations interleaved.

Also ExactResume's own part of each save (its ``state_dict``, on the training thread), over the same memcpy.

Configurations: ``SafetensorsCheckpointIO(async_save=True)`` with and without ``ExactResume``, Lightning's
``AsyncCheckpointIO`` with ``ExactResume``, and Lightning's default ``TorchCheckpointIO`` with it.

Usage: ``python benchmarks/bench_save_in_fit.py --params-mb 300 --repeats 2`` (defaults are small).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_resume import ExactResume, SafetensorsCheckpointIO  # noqa: E402


class Wide(pl.LightningModule):
    """Square layers of ``width`` until the weights reach ``params_mb``; a step is one small batch."""

    def __init__(self, params_mb: int, width: int = 2048) -> None:
        super().__init__()
        layers = max(1, params_mb * 2**20 // (4 * width * width))
        self.net = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])
        self.width = width

    def training_step(self, batch, _):  # type: ignore[no-untyped-def]
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(64, self.width)), batch_size=8)


class StepClock(Callback):
    """Every batch start's time, and the global steps at which a checkpoint was written."""

    def __init__(self) -> None:
        self.starts: List[float] = []
        self.saves: List[int] = []

    def on_train_batch_start(self, *args) -> None:  # type: ignore[no-untyped-def]
        self.starts.append(time.perf_counter())

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:  # type: ignore[no-untyped-def]
        self.saves.append(len(self.starts) - 1)  # the batch index whose end saved


class TimedExactResume(ExactResume):
    """``ExactResume`` whose part of each save (its ``state_dict``, on the training thread) is timed."""

    def __init__(self, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.seconds: List[float] = []

    def state_dict(self):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = super().state_dict()
        self.seconds.append(time.perf_counter() - t0)
        return out


def memcpy_seconds(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> float:
    """A copy of every weight and optimizer tensor into preallocated, touched buffers."""
    tensors = [p.detach() for p in model.parameters()]
    if optimizer is not None:
        tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    buffers = [torch.empty_like(t).fill_(0) for t in tensors]
    t0 = time.perf_counter()
    for dst, src in zip(buffers, tensors):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    return time.perf_counter() - t0


class MemcpyAfterFirstStep(Callback):
    """The memcpy baseline, measured once the optimizer state exists (after the first step)."""

    def __init__(self) -> None:
        self.seconds: Optional[float] = None

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:  # type: ignore[no-untyped-def]
        if self.seconds is None:
            self.seconds = memcpy_seconds(pl_module, trainer.optimizers[0])


def fit(io: Callable[[], object], exact: bool, root: str, params_mb: int, steps: int, every: int) -> Dict:
    clock, baseline = StepClock(), MemcpyAfterFirstStep()
    callbacks: List[Callback] = [
        clock,
        baseline,
        ModelCheckpoint(dirpath=root, every_n_train_steps=every, save_top_k=1),
    ]
    timed = TimedExactResume(mtbf=None, preemption_signals=None)
    if exact:
        callbacks.insert(0, timed)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks, plugins=[io()], logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=root,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer.fit(Wide(params_mb))
    trainer.strategy.checkpoint_io.teardown()
    return {"starts": clock.starts, "saves": clock.saves, "memcpy": baseline.seconds, "exact": timed.seconds[1:]}


def lost_per_save(run: Dict, window: int) -> List[float]:
    """Time lost to each save but the first, in units of the run's memcpy."""
    steps = [b - a for a, b in zip(run["starts"], run["starts"][1:])]
    disturbed = {i for s in run["saves"] for i in range(s, s + window)}
    calm = statistics.median(t for i, t in enumerate(steps) if i not in disturbed and i > 0)
    out = []
    for s in run["saves"][1:]:
        lost = sum(steps[i] - calm for i in range(s, min(s + window, len(steps))))
        out.append(lost / run["memcpy"])
    return out


CONFIGS: Dict[str, tuple] = {
    "ExactResume + SafetensorsCheckpointIO(async_save=True)": (lambda: SafetensorsCheckpointIO(async_save=True), True),
    "SafetensorsCheckpointIO(async_save=True), no ExactResume": (
        lambda: SafetensorsCheckpointIO(async_save=True),
        False,
    ),
    "ExactResume + Lightning AsyncCheckpointIO": (lambda: AsyncCheckpointIO(TorchCheckpointIO()), True),
    "ExactResume + Lightning TorchCheckpointIO": (lambda: TorchCheckpointIO(), True),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params-mb", type=int, default=64)
    p.add_argument("--steps", type=int, default=61)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--only", default=None, help="run only the configurations whose name contains this")
    a = p.parse_args()
    names = [n for n in CONFIGS if a.only is None or a.only in n]
    results: Dict[str, List[float]] = {n: [] for n in names}
    memcpys: Dict[str, List[float]] = {n: [] for n in names}
    exact_parts: Dict[str, List[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
        for r in range(a.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                io, exact = CONFIGS[name]
                run = fit(io, exact, os.path.join(root, f"{r}-{len(results[name])}"), a.params_mb, a.steps, a.every)
                results[name] += lost_per_save(run, a.window)
                memcpys[name].append(run["memcpy"])
                exact_parts[name] += [t / run["memcpy"] for t in run["exact"]]
    state_mb = 3 * a.params_mb
    print(f"state ~{state_mb} MB (weights {a.params_mb} MB + AdamW moments), save every {a.every} steps,")
    print(f"time lost per save over {a.window} steps / memcpy of the state (median, min-max over saves):")
    for name in names:
        v = results[name]
        memcpy = statistics.median(memcpys[name])
        print(
            f"  {name}: {statistics.median(v):.2f}x ({min(v):.2f}-{max(v):.2f}), {len(v)} saves, memcpy {memcpy:.3f}s"
        )
        if exact_parts[name]:
            e = exact_parts[name]
            print(f"    of which ExactResume's state_dict: {statistics.median(e):.3f}x ({min(e):.3f}-{max(e):.3f})")


if __name__ == "__main__":
    main()
