"""Activation checkpointing: saved-activation bytes and step time for none / every block / sqrt / budget.

A pre-norm transformer stack of n = 4, 8, 16, 32 blocks (small width, CPU, one thread). For each
plan it reports the activation bytes kept at the end of forward (counted exactly with
saved-tensor hooks, plus the inputs the checkpoints hold), the estimated peak during backward
(kept + the largest unit being recomputed), and the step time (forward, backward, SGD step; the
plans' steps interleaved, best of ``--repeats``) as a ratio to no checkpointing in the same run,
and the added time in units of one plain forward pass (the cost model says about 1). Prints a Markdown table.

    python benchmarks/bench_activation.py            # about two minutes on one core
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from typing import Callable

import torch
from torch import nn

from lightning_resume.activation.apply import apply_plan
from lightning_resume.activation.measure import block_records, measure_saved_bytes
from lightning_resume.activation.policy import BlockSelection, CheckpointPlan, plan_checkpointing


class TransformerBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d // self.heads), dim=-1)
        x = x + self.drop(self.proj((attn @ v).transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.norm2(x)))


class Model(nn.Module):
    def __init__(self, n: int, width: int, heads: int, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*[TransformerBlock(width, heads) for _ in range(n)])
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def make_plan(model: Model, tokens: torch.Tensor, mode: str, budget_fraction: float) -> CheckpointPlan:
    names = [f"blocks.{i}" for i in range(len(model.blocks))]
    saved = measure_saved_bytes(model, lambda: model(tokens), names)
    budget = int(saved.total * budget_fraction) if mode == "budget" else None
    selection = BlockSelection(classes=(f"{__name__}.TransformerBlock",), mode=mode, budget_bytes=budget)
    return plan_checkpointing(block_records(model, saved), selection, saved.total)


def make_step(model: Model, tokens: torch.Tensor) -> Callable[[], float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        optimizer.step()
        return time.perf_counter() - start

    return step


def make_forward(model: Model, tokens: torch.Tensor) -> Callable[[], float]:
    def forward() -> float:
        start = time.perf_counter()
        model(tokens)
        return time.perf_counter() - start

    return forward


def kept_bytes(model: Model, tokens: torch.Tensor, plan: CheckpointPlan | None) -> int:
    heads = [unit[0] for unit in plan.units] if plan is not None else []
    return measure_saved_bytes(model, lambda: model(tokens), keep_inputs_of=heads).total


def interleaved_min_seconds(steps: list[Callable[[], float]], repeats: int) -> list[float]:
    """Steps of all plans taken in turn, best of ``repeats``: other load on the machine hits them alike."""
    for step in steps:
        step()  # warm-up
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for i, step in enumerate(steps):
            times[i].append(step())
    return [min(t) for t in times]


def rows_for(n: int, args: argparse.Namespace) -> list[list[str]]:
    torch.manual_seed(0)
    base_model = Model(n, args.width, args.heads)
    tokens = torch.randint(0, 256, (args.batch, args.seq))
    plans: dict[str, CheckpointPlan | None] = {
        "none": None,
        "every block": make_plan(base_model, tokens, "all", 0),
        "sqrt": make_plan(base_model, tokens, "sqrt", 0),
        f"budget {args.budget_fraction:.0%}": make_plan(base_model, tokens, "budget", args.budget_fraction),
    }
    models = {label: copy.deepcopy(base_model) for label in plans}
    for label, plan in plans.items():
        if plan is not None:
            apply_plan(models[label], plan)
    kept = {label: kept_bytes(models[label], tokens, plan) for label, plan in plans.items()}
    steps = [make_step(m, tokens) for m in models.values()] + [make_forward(models["none"], tokens)]
    *step_times, forward = interleaved_min_seconds(steps, args.repeats)
    seconds = dict(zip(plans, step_times))
    rows = []
    for label, plan in plans.items():
        units = "-" if plan is None else f"{len(plan.units)} ({len(plan.blocks)} blocks)"
        peak = kept[label] + (plan.peak_recompute_bytes or 0 if plan is not None else 0)
        rows.append(
            [
                str(n),
                label,
                units,
                _mib(kept[label]),
                f"{kept[label] / kept['none']:.2f}",
                _mib(peak),
                f"{seconds[label] * 1e3:.1f}",
                f"{seconds[label] / seconds['none']:.2f}x",
                f"{(seconds[label] - seconds['none']) / forward:.2f}",
            ]
        )
    return rows


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget-fraction", type=float, default=0.5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    header = [
        "n",
        "plan",
        "units",
        "kept MiB",
        "kept vs none",
        "est. peak MiB",
        "step ms",
        "step vs none",
        "extra / forward",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for n in args.sizes:
        for row in rows_for(n, args):
            print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
