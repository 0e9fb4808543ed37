"""A flat training state of a chosen size, the memcpy floor it is measured against, and the command line
that sets both sizes: shared by the benchmarks that time one state (``bench_memory_tier``, ``bench_s3``);
a small model with AdamW whose state is that size (``bench_memory_tier --model``, ``bench_async``); and the
LightningModule of square layers the fits time (``bench_save_in_fit``, ``bench_replica``)."""

from __future__ import annotations

import argparse
import ctypes
import time
from dataclasses import dataclass
from typing import List

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def flat_state(size_mb: int) -> dict:
    """A checkpoint of ``size_mb`` MB: eight equal float32 tensors and a step."""
    n = size_mb * (1 << 20) // 4 // 8
    return {"state_dict": {f"layer{i}.weight": torch.randn(n) for i in range(8)}, "global_step": 1}


def memcpy_seconds(state: dict, buffers: dict[str, torch.Tensor]) -> float:
    """Seconds to copy every tensor of ``state["state_dict"]`` into its preallocated buffer (the floor)."""
    started = time.perf_counter()
    for key, tensor in state["state_dict"].items():
        buffers[key].copy_(tensor)
    return time.perf_counter() - started


def size_parser(doc: str, size_mb: int, repeats: int) -> argparse.ArgumentParser:
    """``--size-mb`` (of the state) and ``--repeats`` (interleaved), with these defaults."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=size_mb)
    parser.add_argument("--repeats", type=int, default=repeats)
    return parser


@dataclass
class ModelState:
    """Linear layers and AdamW after one step: ``tensors`` are the weights and moments a save copies."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    x: torch.Tensor
    tensors: List[torch.Tensor]
    buffers: List[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def checkpoint(self) -> dict:
        return {"state_dict": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def step(self) -> None:
        self.optimizer.zero_grad()
        self.model(self.x).sum().backward()
        self.optimizer.step()

    def memcpy_seconds(self) -> float:
        """Seconds to copy every state tensor into its preallocated buffer (the floor)."""
        started = time.perf_counter()
        for dst, src in zip(self.buffers, self.tensors, strict=True):
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.nbytes)
        return time.perf_counter() - started


def model_state(size_mb: float, width: int = 1024) -> ModelState:
    """A :class:`ModelState` of about ``size_mb`` MB (weights and two AdamW moments), seeded."""
    torch.manual_seed(0)
    layers = max(1, int(size_mb * 1e6 / 3 / (width * width * 4)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters())
    state = ModelState(model, opt, torch.randn(64, width), [], [])
    state.step()
    state.tensors = [*model.state_dict().values()]
    state.tensors += [t for st in opt.state.values() for t in st.values() if t.numel() > 1]
    state.buffers = [torch.empty_like(t).zero_() for t in state.tensors]
    return state


class Wide(pl.LightningModule):
    """Square layers of ``width`` until the weights reach ``params_mb``; a step is one small batch of 8 out of
    ``samples`` random rows."""

    def __init__(self, params_mb: float, width: int = 2048, samples: int = 64) -> None:
        super().__init__()
        layers = max(1, int(params_mb * 2**20 // (4 * width * width)))
        self.net = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])
        self.width, self.samples = width, samples

    def training_step(self, batch, _):
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(self.samples, self.width)), batch_size=8)
