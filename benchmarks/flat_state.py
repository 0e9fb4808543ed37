"""A flat training state of a chosen size, the memcpy floor it is measured against, and the command line
that sets both sizes: shared by the benchmarks that time one state (``bench_memory_tier``, ``bench_s3``)."""

from __future__ import annotations

import argparse
import time

import torch


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
