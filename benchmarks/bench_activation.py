"""Activation checkpointing: kept activation bytes and step time for none / full / sqrt / budget / selective.

A pre-norm transformer stack of n = 4, 8, 16, 32 blocks (small width, CPU, one thread). Plans:
no checkpointing; every block recomputed whole; ``sqrt`` segments; the budget planner at
``--budget-fraction`` of the plain activations choosing none/full per block; every block recomputed
selectively (the outputs of matmuls, convolutions and fused attention kept, the rest rerun); and the
budget planner choosing none/selective/full per block from measured op times.

For each plan it reports the activation bytes kept at the end of forward (every storage the forward
created that is still alive when it returns: autograd's saved tensors, checkpoint inputs and the
selective cache, counted with a dispatch mode), the estimated peak during backward (kept + the
largest unit being recomputed), and the step time (forward, backward, SGD step) as a ratio to no
checkpointing: the plans' steps are interleaved, each round gives one ratio per plan, and the table
shows the median ratio with its spread (min-max over rounds), plus the added time in units of one
plain forward pass. Times are the CPU time of the training thread (``time.thread_time``: with one
intra-op thread, forward, backward and the optimizer step all run on it), which other processes
on a shared machine do not inflate the way they inflate wall-clock time; the wall-clock median
ratio is shown beside it. ``--profile`` adds where forward time and memory go, op by op.

    python benchmarks/bench_activation.py                 # a few minutes on one core
    python benchmarks/bench_activation.py --sizes 8 --attention sdpa --dropout 0 --profile
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_resume.activation.apply import apply_plan, keeps_output, resolve_save_ops
from lightning_resume.activation.measure import (
    block_records,
    measure_kept_bytes,
    measure_recompute,
    measure_saved_bytes,
)
from lightning_resume.activation.policy import DEFAULT_SAVE_OPS, BlockSelection, CheckpointPlan, plan_checkpointing


class TransformerBlock(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float, sdpa: bool) -> None:
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v)
        else:
            y = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d // self.heads), dim=-1) @ v
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.norm2(x)))


class Model(nn.Module):
    def __init__(self, n: int, width: int, heads: int, dropout: float = 0.1, sdpa: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.blocks = nn.Sequential(*[TransformerBlock(width, heads, dropout, sdpa) for _ in range(n)])
        self.head = nn.Linear(width, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


MATMULS_ONLY = ("aten.mm", "aten.addmm")
"""A narrower ``save_ops``: keep the Linear outputs, rerun attention's ``bmm`` (its t x t scores are large)."""


def make_plan(
    model: Model,
    tokens: torch.Tensor,
    mode: str,
    recompute: str,
    budget_fraction: float,
    save_ops: tuple[str, ...] = DEFAULT_SAVE_OPS,
) -> CheckpointPlan:
    names = [f"blocks.{i}" for i in range(len(model.blocks))]
    saved = measure_saved_bytes(model, lambda: model(tokens), names)
    costs = None
    if recompute == "selective":
        save = resolve_save_ops(save_ops)
        costs = measure_recompute(model, lambda: model(tokens), names, lambda op, a, k: keeps_output(save, op, a, k))
    budget = int(saved.total * budget_fraction) if mode == "budget" else None
    selection = BlockSelection(
        classes=(f"{__name__}.TransformerBlock",),
        mode=mode,
        budget_bytes=budget,
        recompute=recompute,  # type: ignore[arg-type]
        save_ops=save_ops,
    )
    return plan_checkpointing(block_records(model, saved, costs), selection, saved.total)


def make_step(model: Model, tokens: torch.Tensor) -> Callable[[], tuple[float, float]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.thread_time()
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(tokens).flatten(0, 1), tokens.flatten()).backward()  # CPU backward: this thread
        optimizer.step()
        return time.perf_counter() - start, time.thread_time() - cpu

    return step


def make_forward(model: Model, tokens: torch.Tensor) -> Callable[[], tuple[float, float]]:
    def forward() -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.thread_time()
        model(tokens)
        return time.perf_counter() - start, time.thread_time() - cpu

    return forward


def interleaved(steps: list[Callable[[], tuple[float, float]]], repeats: int) -> list[list[tuple[float, float]]]:
    """Steps of all plans taken in turn, ``repeats`` rounds: other load on the machine hits them alike."""
    for step in steps:
        step()  # warm-up
    times: list[list[tuple[float, float]]] = [[] for _ in steps]
    for _ in range(repeats):
        for i, step in enumerate(steps):
            times[i].append(step())
    return times


def plans_for(model: Model, tokens: torch.Tensor, fraction: float) -> dict[str, CheckpointPlan | None]:
    return {
        "none": None,
        "full, every block": make_plan(model, tokens, "all", "full", 0),
        "full, sqrt": make_plan(model, tokens, "sqrt", "full", 0),
        f"budget {fraction:.0%} (none/full)": make_plan(model, tokens, "budget", "full", fraction),
        "selective, every block": make_plan(model, tokens, "all", "selective", 0),
        "selective (mm, addmm only)": make_plan(model, tokens, "all", "selective", 0, MATMULS_ONLY),
        f"budget {fraction:.0%} (none/sel/full)": make_plan(model, tokens, "budget", "selective", fraction),
    }


def rows_for(n: int, args: argparse.Namespace) -> list[list[str]]:
    torch.manual_seed(0)
    base_model = Model(n, args.width, args.heads, args.dropout, args.attention == "sdpa")
    tokens = torch.randint(0, 256, (args.batch, args.seq))
    plans = plans_for(base_model, tokens, args.budget_fraction)
    models = {label: copy.deepcopy(base_model) for label in plans}
    for label, plan in plans.items():
        if plan is not None:
            apply_plan(models[label], plan)
    kept = {label: measure_kept_bytes(lambda m=models[label]: m(tokens)) for label in plans}
    steps = [make_step(m, tokens) for m in models.values()] + [make_forward(models["none"], tokens)]
    *step_times, forward_times = interleaved(steps, args.repeats)
    times = {label: [cpu for _, cpu in t] for label, t in zip(plans, step_times, strict=True)}
    walls = {label: [wall for wall, _ in t] for label, t in zip(plans, step_times, strict=True)}
    forward = [cpu for _, cpu in forward_times]
    rows = []
    for label, plan in plans.items():
        ratios = [t / b for t, b in zip(times[label], times["none"], strict=True)]
        wall = statistics.median(w / b for w, b in zip(walls[label], walls["none"], strict=True))
        extra = (statistics.median(times[label]) - statistics.median(times["none"])) / statistics.median(forward)
        peak = kept[label] + (plan.peak_recompute_bytes or 0 if plan is not None else 0)
        rows.append(
            [
                str(n),
                label,
                _units(plan),
                _mib(kept[label]),
                f"{kept[label] / kept['none']:.2f}",
                _mib(peak),
                f"{statistics.median(times[label]) * 1e3:.1f}",
                f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
                f"{wall:.2f}x",
                f"{extra:.2f}",
            ]
        )
    return rows


def _units(plan: CheckpointPlan | None) -> str:
    if plan is None:
        return "-"
    full = sum(len(u) for u in plan.units)
    return f"{full} full, {len(plan.selective)} sel" if plan.selective else f"{len(plan.units)} ({full} blocks)"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f}"


class _OpProfile(TorchDispatchMode):
    """Forward time and output bytes per op kind, and whether selective recomputation keeps it."""

    def __init__(self) -> None:
        super().__init__()
        self.save = resolve_save_ops(DEFAULT_SAVE_OPS)
        self.seconds: dict[str, float] = defaultdict(float)
        self.bytes: dict[str, int] = defaultdict(int)
        self.kept: dict[str, bool] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        start = time.perf_counter()
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        self.seconds[name] += time.perf_counter() - start
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.bytes[name] += sum(  # new storages only: a view's result is not new memory
            t.untyped_storage().nbytes()
            for t in tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs
        )
        self.kept[name] = keeps_output(self.save, func, args, kwargs)
        return out


def profile(n: int, args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = Model(n, args.width, args.heads, args.dropout, args.attention == "sdpa")
    tokens = torch.randint(0, 256, (args.batch, args.seq))
    runs = []
    for _ in range(3):
        prof = _OpProfile()
        with prof, torch.enable_grad():
            model(tokens)
        runs.append(prof)
    prof = min(runs, key=lambda p: sum(p.seconds.values()))
    total = sum(prof.seconds.values())
    print(f"\nforward ops, n={n} (best of 3 forwards; 'new MiB': storage each op's results allocate):\n")
    print("| op | forward ms | share of forward | new MiB | selective |")
    print("|---|---|---|---|---|")
    for name, sec in sorted(prof.seconds.items(), key=lambda kv: -kv[1])[:12]:
        kept = "kept" if prof.kept[name] else "rerun"
        print(f"| {name} | {sec * 1e3:.1f} | {sec / total:.0%} | {_mib(prof.bytes[name])} | {kept} |")
    rerun = sum(s for k, s in prof.seconds.items() if not prof.kept[k])
    print(f"\nops selective recomputation reruns: {rerun / total:.0%} of forward time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget-fraction", type=float, default=0.5)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--attention", choices=["manual", "sdpa"], default="manual")
    parser.add_argument("--profile", action="store_true", help="also print forward time and bytes per op")
    args = parser.parse_args()
    torch.set_num_threads(1)
    header = [
        "n",
        "plan",
        "units",
        "kept MiB",
        "kept vs none",
        "est. peak MiB",
        "step CPU ms",
        "step vs none (CPU)",
        "wall vs none",
        "extra / fwd",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for n in args.sizes:
        for row in rows_for(n, args):
            print("| " + " | ".join(row) + " |", flush=True)
    if args.profile:
        profile(args.sizes[0], args)


if __name__ == "__main__":
    main()
