"""Monte Carlo check that Young's / Daly's interval minimises the time lost to saves and failures.

Training needs ``work`` seconds of computation. Every ``tau`` seconds of computation (rounded up to
a whole number of steps: saves happen at step boundaries) it blocks ``C`` seconds to save.
Failures arrive as a Poisson process (exponential inter-failure times, mean ``M``); a failure loses
everything since the last completed save, then the job restarts (``--restart`` seconds, during
which it can fail again). The simulation steps from failure to failure, vectorised over seeds and
over intervals (the same failure draws for every interval: common random numbers), so a sweep of
100+ intervals over 1000 seeds runs in seconds.

Compared: Young ``sqrt(2CM)``, Daly 2006, fixed "every 30 min" and "every 1000 steps", and the best
fixed interval found by sweeping ``tau`` over a log grid from one step to 1.5 M (the optimum of
the Poisson model is always below M). Waste = fraction of
wall time not spent on useful computation. C defaults to a measured blocking cost of this machine:
copying a ~100 MB state into preallocated buffers (the snapshot half of an async save).

    python benchmarks/interval_sim.py                 # the README table
    python benchmarks/interval_sim.py --seeds 50 --c 0.05 --mtbf 15min   # quick look
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightning_resume.durations import parse_duration
from lightning_resume.schedule.policy import daly_interval, young_interval


def measure_copy_cost(megabytes: int = 100, repeats: int = 7) -> float:
    """Median seconds to copy a ``megabytes`` state (16 tensors) into preallocated buffers."""
    import torch

    torch.set_num_threads(1)
    n = megabytes * 2**20 // 4 // 16
    src = [torch.randn(n) for _ in range(16)]
    dst = [torch.empty_like(t) for t in src]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def simulate(
    taus: np.ndarray, c: float, m: float, work: float, seeds: int, restart: float = 0.0, rng_seed: int = 0
) -> np.ndarray:
    """Waste fraction, shape (len(taus), seeds), of running ``work`` seconds with saves every ``tau``.

    One iteration per failure ("life"); every (tau, seed) pair uses the same failure draws of its
    seed. Finished pairs are dropped from the working arrays, so hopeless intervals cost little.
    """
    rng = np.random.default_rng(rng_seed)
    taus = np.asarray(taus, dtype=float)
    tau = np.repeat(taus, seeds)  # flattened (tau, seed) pairs
    seed = np.tile(np.arange(seeds), len(taus))
    need = np.ceil(work / tau)  # segments (tau of work + a save) still to complete
    useful = need * tau
    wall = np.zeros_like(tau)
    idx = np.arange(tau.size)  # pairs still running
    life = 0
    while idx.size:
        x = rng.exponential(m, size=seeds)[seed[idx]]  # this life's time to failure
        r = restart if life > 0 else 0.0
        segment = tau[idx] + c
        done = np.floor(np.clip(x - r, 0.0, None) / segment)  # segments completed before the failure
        finish = done >= need[idx]
        wall[idx] += np.where(finish, r + need[idx] * segment, x)
        need[idx] -= np.where(finish, 0.0, done)
        idx = idx[~finish]
        life += 1
    return (1.0 - useful / wall).reshape(len(taus), seeds)


@dataclass
class Scenario:
    m: float
    c: float
    step_time: float
    restart: float
    work: float
    seeds: int


def _steps(tau: float, step_time: float) -> float:
    return max(1.0, math.ceil(tau / step_time - 1e-9)) * step_time


def run_scenario(s: Scenario, sweep_points: int = 120, rng_seed: int = 0) -> Dict[str, float]:
    """Mean waste of each policy and of the best swept fixed interval."""
    policies = {
        "young": _steps(young_interval(s.c, s.m), s.step_time),
        "daly": _steps(daly_interval(s.c, s.m), s.step_time),
        "every_30min": _steps(1800.0, s.step_time),
        "every_1000_steps": 1000 * s.step_time,
    }
    grid = np.unique([_steps(t, s.step_time) for t in np.geomspace(s.step_time, 1.5 * s.m, sweep_points)])
    taus = np.concatenate([np.array(list(policies.values())), grid])
    waste = simulate(taus, s.c, s.m, s.work, s.seeds, s.restart, rng_seed).mean(axis=1)
    result = {name: float(waste[i]) for i, name in enumerate(policies)}
    result.update({f"{name}_s": tau for name, tau in policies.items()})
    best = int(np.argmin(waste[len(policies) :]))
    result["best"] = float(waste[len(policies) + best])
    result["best_s"] = float(grid[best])
    result["curve_s"] = grid.tolist()
    result["curve"] = waste[len(policies) :].tolist()
    return result


def fmt(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def table(rows: List[Dict[str, float]]) -> str:
    head = (
        "| M | C | T* Young | T* Daly | best fixed T (sweep) | waste Young | waste Daly | waste best | "
        "every 30 min | every 1000 steps | Young / best | Daly / best |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {fmt(r['m'])} | {fmt(r['c'])} | {fmt(r['young_s'])} | {fmt(r['daly_s'])} | {fmt(r['best_s'])} | "
            f"{r['young']:.2%} | {r['daly']:.2%} | {r['best']:.2%} | {r['every_30min']:.2%} | "
            f"{r['every_1000_steps']:.2%} | {r['young'] / r['best']:.3f} | {r['daly'] / r['best']:.3f} |"
        )
    return "\n".join(lines)


def plot(rows: Sequence[Dict[str, float]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib); table printed above", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, len(rows), figsize=(4 * len(rows), 3.5), squeeze=False)
    for ax, r in zip(axes[0], rows):
        ax.plot(r["curve_s"], [100 * w for w in r["curve"]], label="fixed T (simulated)")
        for name, color in (("young", "C1"), ("daly", "C2"), ("every_30min", "C3"), ("every_1000_steps", "C4")):
            ax.plot(r[f"{name}_s"], 100 * r[name], "o", color=color, label=name)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="interval (s)",
            ylabel="waste (%)",
            title=f"M={fmt(r['m'])}, C={fmt(r['c'])}",
        )
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}", file=sys.stderr)


def main(argv: Sequence[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--c", action="append", help="blocking cost(s) C; default: measured copy, 30s, 5min")
    p.add_argument("--mtbf", action="append", help="job MTBF(s) M; default: 15min, 6h, 24h")
    p.add_argument("--step-time", default="1s", help="seconds per training step (default 1s)")
    p.add_argument(
        "--restart", default="0s", help="restart cost after a failure (default 0: it adds ~R/M to every policy alike)"
    )
    p.add_argument("--work-mtbfs", type=float, default=100.0, help="training work, in units of M (default 100)")
    p.add_argument("--seeds", type=int, default=1000)
    p.add_argument("--plot", metavar="PNG")
    args = p.parse_args(argv)

    measured = measure_copy_cost()
    print(
        f"measured blocking cost: copy of 100 MB into preallocated buffers = {measured * 1e3:.1f} ms", file=sys.stderr
    )
    costs = [parse_duration(c, "--c") for c in args.c] if args.c else [measured, 30.0, 300.0]
    mtbfs = [parse_duration(m, "--mtbf") for m in args.mtbf] if args.mtbf else [900.0, 6 * 3600.0, 86400.0]
    step, restart = parse_duration(args.step_time, "--step-time"), parse_duration(args.restart, "--restart")
    start, rows = time.perf_counter(), []
    for m in mtbfs:
        for c in costs:
            s = Scenario(m=m, c=c, step_time=step, restart=restart, work=args.work_mtbfs * m, seeds=args.seeds)
            rows.append({"m": m, "c": c, **run_scenario(s)})
    print(table(rows))
    print(
        f"\n{args.seeds} seeds x {len(rows)} scenarios, work = {args.work_mtbfs:g} M each, step {fmt(step)}, "
        f"restart {fmt(restart)}; {time.perf_counter() - start:.1f} s",
        file=sys.stderr,
    )
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
