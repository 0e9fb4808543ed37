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

    python benchmarks/interval_sim.py                 # the table in RESULTS.md, "Checkpoint interval"
    python benchmarks/interval_sim.py --seeds 50 --c 0.05 --mtbf 15min   # quick look

Two failure classes (``--two-level``): process failures (exponential, mean ``--m1``) roll back to
the newest memory snapshot, node failures (mean ``--m2``) to the newest durable save. A memory
snapshot every ``T1`` of computation blocks ``C1``; every ``k``-th one is also durable and blocks
``C1 + C2`` (the cost model of ``schedule.formulas.two_level_waste``). Compared: the two-level plan
(``two_level_plan``), the single-level optimum that sends every failure to disk (Young and Daly
with ``C = C2`` and ``M = 1/(1/M1 + 1/M2)``), the best swept single interval and the best swept
pair (T1, k). ``--measure`` first measures C1 (copying a ``--state-mb`` state into a preallocated
buffer backed by a ``/dev/shm`` file) and C2 (a synchronous ``SafetensorsCheckpointIO`` save of
the same state to ``--durable-dir``, fsync included) and uses them:

    python benchmarks/interval_sim.py --two-level --measure --m1 1h --m2 24h   # RESULTS.md, "Two-level schedule"

Three failure classes (``--three-level``): with replicas on peer nodes, process losses go back to the
newest memory snapshot, node losses to the newest replica (the newest snapshot once its transfer of
``D2`` seconds has landed; before that, to the newest durable save: the peers still hold the previous
snapshot), whole-job losses to the newest durable save. A snapshot blocks ``C1 + C2`` (C2: the transfer's
cost to training), every ``k``-th one is durable and blocks ``C3`` more. On a published failure mix (the
Llama 3 run's: ``--mix``), compared in one run: the three-level plan (``three_level_plan``), the two-level
plan that sends node and job losses to disk, and the best swept replicating (T1, k):

    python benchmarks/interval_sim.py --three-level          # RESULTS.md, "Three-level schedule"
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
from lightning_resume.schedule.formulas import (
    Levels,
    daly_interval,
    single_level_waste,
    three_level_plan,
    two_level_plan,
    young_interval,
)
from lightning_resume.schedule.state import REPLICA_STEP_OVERHEAD


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


# --------------------------------------------------------------------------------------------
# Two failure classes
# --------------------------------------------------------------------------------------------


def _position(t: np.ndarray, seg: np.ndarray, k: np.ndarray, c2: float) -> np.ndarray:
    """Segments completed after ``t`` seconds from the start: a cycle is ``k`` segments of ``seg``
    (``T1 + C1``) plus ``C2`` at the k-th, which the save ends."""
    cycle = k * seg + c2
    cycles = np.floor(t / cycle)
    within = np.minimum(np.floor((t - cycles * cycle) / seg), k - 1)
    return cycles * k + within


def _elapsed(j: np.ndarray, seg: np.ndarray, k: np.ndarray, c2: float) -> np.ndarray:
    """Seconds from the start to the end of segment ``j`` (inverse of ``_position``)."""
    return j * seg + np.floor(j / k) * c2


def simulate_two_level(
    t1s: np.ndarray,
    ks: np.ndarray,
    c1: float,
    c2: float,
    m1: float,
    m2: float,
    work: float,
    seeds: int,
    restart: float = 0.0,
    rng_seed: int = 0,
    memory: bool = True,
) -> np.ndarray:
    """Waste fraction, shape (len(t1s), seeds), of ``work`` seconds under plan i = (t1s[i], ks[i]).

    One iteration per failure, vectorised over (plan, seed) pairs with common random numbers (a
    seed's failure times and classes are the same for every plan). ``memory=False`` is the
    single-level baseline: every failure goes back to the newest durable save (use ``k = 1``,
    ``c1 = 0``)."""
    rng = np.random.default_rng(rng_seed)
    rate = 1.0 / m1 + 1.0 / m2
    t1 = np.repeat(np.asarray(t1s, dtype=float), seeds)
    k = np.repeat(np.asarray(ks, dtype=float), seeds)
    seed = np.tile(np.arange(seeds), len(t1s))
    seg = t1 + c1
    need = np.ceil(work / t1)
    useful = need * t1
    pos = np.zeros_like(t1)  # segments completed at the restart point
    wall = np.zeros_like(t1)
    idx = np.arange(t1.size)
    life = 0
    while idx.size:
        x = rng.exponential(1.0 / rate, size=seeds)[seed[idx]]
        is_process = (rng.random(size=seeds) < (1.0 / m1) / rate)[seed[idx]]
        r = restart if life > 0 else 0.0
        kk, sg = k[idx], seg[idx]
        base = _elapsed(pos[idx], sg, kk, c2)
        reached = _position(base + np.clip(x - r, 0.0, None), sg, kk, c2)
        finish = reached >= need[idx]
        wall[idx] += np.where(finish, r + _elapsed(need[idx], sg, kk, c2) - base, x)
        durable = np.floor(reached / kk) * kk
        pos[idx] = np.where(is_process & memory, reached, durable)
        idx = idx[~finish]
        life += 1
    return (1.0 - useful / wall).reshape(len(t1s), seeds)


@dataclass
class TwoLevelScenario:
    m1: float
    m2: float
    c1: float
    c2: float
    step_time: float
    restart: float
    work: float
    seeds: int


def run_two_level(s: TwoLevelScenario, t1_points: int = 60, rng_seed: int = 0) -> Dict[str, float]:
    """Mean simulated waste: two-level plan, single-level Young/Daly, best swept T and (T1, k)."""
    plan = two_level_plan(s.c1, s.c2, s.m1, s.m2)
    m = 1.0 / (1.0 / s.m1 + 1.0 / s.m2)
    sim = dict(c2=s.c2, m1=s.m1, m2=s.m2, work=s.work, seeds=s.seeds, restart=s.restart, rng_seed=rng_seed)
    singles = {"young": young_interval(s.c2, m), "daly": daly_interval(s.c2, m)}
    grid = np.unique([_steps(t, s.step_time) for t in np.geomspace(s.step_time, 1.5 * m, 4 * t1_points)])
    taus = np.array([_steps(t, s.step_time) for t in singles.values()] + grid.tolist())
    single = simulate_two_level(taus, np.ones_like(taus), 0.0, memory=False, **sim).mean(axis=1)
    t1_grid = np.unique([_steps(t, s.step_time) for t in np.geomspace(s.step_time, 1.5 * s.m1, t1_points)])
    k_grid = np.unique(np.round(np.geomspace(1, max(4.0, 4 * plan.k), 30)))
    pairs = [(_steps(plan.t1, s.step_time), plan.k)] + [(t, k) for t in t1_grid for k in k_grid]
    two = simulate_two_level(np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs]), s.c1, **sim)
    two_mean = two.mean(axis=1)
    best = 1 + int(np.argmin(two_mean[1:]))
    best_single = 2 + int(np.argmin(single[2:]))
    return {
        "plan_t1": plan.t1,
        "plan_k": float(plan.k),
        "plan_model": plan.waste,
        "plan": float(two_mean[0]),
        "plan_ci": float(1.96 * two[0].std(ddof=1) / math.sqrt(s.seeds)),
        "young_s": singles["young"],
        "young": float(single[0]),
        "young_model": single_level_waste(s.c2, s.m1, s.m2),
        "daly": float(single[1]),
        "best_single_s": float(taus[best_single]),
        "best_single": float(single[best_single]),
        "best_t1": float(pairs[best][0]),
        "best_k": float(pairs[best][1]),
        "best": float(two_mean[best]),
    }


def two_level_table(rows: List[Dict[str, float]]) -> str:
    head = (
        "| M1 | M2 | C1 | C2 | two-level T1, k (T2) | waste two-level (sim ± 95% CI) | model | "
        "single-level Young T* | waste Young | waste Daly | best single T (sweep) | best (T1, k) (sweep) | "
        "Young / two-level | two-level / best pair |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {fmt(r['m1'])} | {fmt(r['m2'])} | {fmt(r['c1'])} | {fmt(r['c2'])} | "
            f"{fmt(r['plan_t1'])}, {r['plan_k']:.0f} ({fmt(r['plan_t1'] * r['plan_k'])}) | "
            f"{r['plan']:.2%} ± {r['plan_ci']:.2%} | {r['plan_model']:.2%} | {fmt(r['young_s'])} | "
            f"{r['young']:.2%} | {r['daly']:.2%} | {fmt(r['best_single_s'])}: {r['best_single']:.2%} | "
            f"{fmt(r['best_t1'])}, {r['best_k']:.0f}: {r['best']:.2%} | {r['young'] / r['plan']:.2f}x | "
            f"{r['plan'] / r['best']:.3f} |"
        )
    return "\n".join(lines)


def measure_two_level_costs(state_mb: float, durable_dir: str, repeats: int = 5) -> Dict[str, float]:
    """Median C1 and C2 (seconds) and their per-repeat spread for a ``state_mb`` state.

    C1: copying every tensor into a preallocated buffer backed by a ``/dev/shm`` file (the memory
    tier's snapshot; pages touched once beforehand, as a reused snapshot buffer is). C2: a synchronous
    ``SafetensorsCheckpointIO`` save to ``durable_dir`` (checksums, fsync, atomic rename), the
    blocking cost of a durable save without async; interleaved with C1 in each repeat."""
    import statistics
    import tempfile

    import torch

    from lightning_resume import SafetensorsCheckpointIO

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_io import all_tensors, make_state

    torch.set_num_threads(1)
    state = make_state(state_mb)
    tensors = all_tensors(state)
    numel = sum(t.numel() for t in tensors)
    io = SafetensorsCheckpointIO()
    shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    c1s, c2s = [], []
    with (
        tempfile.NamedTemporaryFile(dir=shm_dir, prefix="lr-bench-") as shm,
        tempfile.TemporaryDirectory(dir=durable_dir) as disk,
    ):
        flat = torch.from_file(shm.name, shared=True, size=numel, dtype=torch.float32)
        flat.fill_(0.0)  # touch the pages: a snapshot buffer is allocated once and reused
        views, offset = [], 0
        for t in tensors:
            views.append(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
        for i in range(repeats):
            os.sync()
            start = time.perf_counter()
            for dst, src in zip(views, tensors):
                dst.copy_(src)
            c1s.append(time.perf_counter() - start)
            path = os.path.join(disk, f"state-{i}.ckpt")
            os.sync()
            start = time.perf_counter()
            io.save_checkpoint(state, path)
            c2s.append(time.perf_counter() - start)
            os.remove(path)
        del views, flat
    ratios = [b / a for a, b in zip(c1s, c2s)]
    return {
        "bytes": float(numel * 4),
        "c1": statistics.median(c1s),
        "c2": statistics.median(c2s),
        "c1_min": min(c1s),
        "c1_max": max(c1s),
        "c2_min": min(c2s),
        "c2_max": max(c2s),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def main_two_level(args: argparse.Namespace) -> int:
    step, restart = parse_duration(args.step_time, "--step-time"), parse_duration(args.restart, "--restart")
    m1s = [parse_duration(m, "--m1") for m in args.m1] if args.m1 else [3600.0]
    m2s = [parse_duration(m, "--m2") for m in args.m2] if args.m2 else [86400.0]
    pairs = [(parse_duration(args.c1, "--c1"), parse_duration(args.c2, "--c2"))]
    if args.measure:
        cost = measure_two_level_costs(args.state_mb, args.durable_dir, args.repeats)
        print(
            f"measured on this machine, {cost['bytes'] / 1e6:.0f} MB state, median of {args.repeats}: "
            f"C1 (copy into /dev/shm buffer) = {cost['c1'] * 1e3:.0f} ms [{cost['c1_min'] * 1e3:.0f}-"
            f"{cost['c1_max'] * 1e3:.0f}], C2 (synchronous safetensors save + fsync) = {cost['c2'] * 1e3:.0f} ms "
            f"[{cost['c2_min'] * 1e3:.0f}-{cost['c2_max'] * 1e3:.0f}], C2/C1 = {cost['ratio']:.1f}x "
            f"[{cost['ratio_min']:.1f}-{cost['ratio_max']:.1f}]",
            file=sys.stderr,
        )
        pairs = [(cost["c1"], cost["c2"])] + pairs
    start, rows = time.perf_counter(), []
    for m1 in m1s:
        for m2 in m2s:
            for c1, c2 in pairs:
                m = 1.0 / (1.0 / m1 + 1.0 / m2)
                s = TwoLevelScenario(m1, m2, c1, c2, step, restart, args.work_mtbfs * m, args.seeds)
                rows.append({"m1": m1, "m2": m2, "c1": c1, "c2": c2, **run_two_level(s)})
    print(two_level_table(rows))
    print(
        f"\n{args.seeds} seeds x {len(rows)} scenarios, work = {args.work_mtbfs:g} x (1/M1 + 1/M2)^-1 each, "
        f"step {fmt(step)}, restart {fmt(restart)}; {time.perf_counter() - start:.1f} s",
        file=sys.stderr,
    )
    return 0


# --------------------------------------------------------------------------------------------
# Three failure classes (replicas on peer nodes)
# --------------------------------------------------------------------------------------------

LLAMA3_RUN_S = 54 * 86400.0
"""Llama 3 405B pre-training (Llama 3 paper, 2024, section 3.3.4 and table 5): 419 unexpected interruptions
in a 54-day snapshot on 16,384 H100 (2,048 nodes). Software (bugs 54, NCCL watchdog timeouts 7, dependencies
2: 63) leaves the node up; every other cause (GPU, HBM, SRAM, host maintenance, NIC, network switch and cable,
SSD, power, chassis, CPU...: 356) takes one node out. None is reported to have taken every node's memory."""

MIXES = {
    # job-wide MTBFs (M1 process, M2 node, M3 whole job); M3: none in 54 days, counted as one
    "llama3": (LLAMA3_RUN_S / 63, LLAMA3_RUN_S / 356, LLAMA3_RUN_S),
    # the 35 network switch/cable interruptions as whole-job losses (a rack's switch takes a node and its ring
    # neighbour, the replica holder, together): the pessimistic reading of the same table
    "llama3-switch-as-job": (LLAMA3_RUN_S / 63, LLAMA3_RUN_S / 321, LLAMA3_RUN_S / 35),
}


def simulate_three_level(
    t1s: np.ndarray,
    ks: np.ndarray,
    replicate: np.ndarray,
    levels: Levels,
    work: float,
    seeds: int,
    restart: float = 0.0,
    rng_seed: int = 0,
) -> np.ndarray:
    """Waste fraction, shape (len(t1s), seeds), of ``work`` seconds under plan i = (t1s[i], ks[i],
    replicate[i]); common random numbers as ``simulate_two_level`` (a seed's failure times and classes are
    the same for every plan). A plan that does not replicate pays no C2 and sends node losses to disk."""
    rng = np.random.default_rng(rng_seed)
    lv = levels
    rates = np.array([1.0 / lv.m1, 1.0 / lv.m2, 1.0 / lv.m3])
    bounds = np.cumsum(rates) / rates.sum()
    t1 = np.repeat(np.asarray(t1s, dtype=float), seeds)
    k = np.repeat(np.asarray(ks, dtype=float), seeds)
    rep = np.repeat(np.asarray(replicate, dtype=bool), seeds)
    seed = np.tile(np.arange(seeds), len(t1s))
    seg = t1 + lv.c1 + np.where(rep, lv.c2, 0.0)
    need = np.ceil(work / t1)
    useful = need * t1
    pos, wall = np.zeros_like(t1), np.zeros_like(t1)
    held = np.ones_like(t1, dtype=bool)  # whether the peers hold a replica of the restart point's state
    idx, life = np.arange(t1.size), 0
    while idx.size:
        x = rng.exponential(1.0 / rates.sum(), size=seeds)[seed[idx]]
        u = rng.random(size=seeds)[seed[idx]]
        process, node = u < bounds[0], (u >= bounds[0]) & (u < bounds[1])
        r = restart if life > 0 else 0.0
        kk, sg = k[idx], seg[idx]
        base = _elapsed(pos[idx], sg, kk, lv.c3)
        failed_at = base + np.clip(x - r, 0.0, None)
        reached = _position(failed_at, sg, kk, lv.c3)
        finish = reached >= need[idx]
        wall[idx] += np.where(finish, r + _elapsed(need[idx], sg, kk, lv.c3) - base, x)
        # the newest snapshot's replica has landed (no snapshot since the restart point: whether that one's had)
        landed = np.where(reached == pos[idx], held[idx], failed_at - _elapsed(reached, sg, kk, lv.c3) >= lv.d2)
        keep = process | (node & rep[idx] & landed)
        pos[idx] = np.where(keep, reached, np.floor(reached / kk) * kk)
        held[idx] = np.where(keep, landed | node, True)  # a durable point needs none: it is on disk
        idx = idx[~finish]
        life += 1
    return (1.0 - useful / wall).reshape(len(t1s), seeds)


def run_three_level(
    levels: Levels, step_time: float, work: float, seeds: int, restart: float = 0.0, rng_seed: int = 0
) -> Dict[str, float]:
    """Mean simulated waste of the three-level plan, the two-level plan (no replicas) and the best swept
    replicating (T1, k), all in one simulation (the same failures)."""
    plan, two = three_level_plan(levels), two_level_plan(*levels.without_replicas())
    # around the plan (far longer intervals are hopeless and would only slow the simulation: a life rarely ends one)
    t1_grid = np.unique(
        [_steps(t, step_time) for t in np.geomspace(max(step_time, levels.d2, plan.t1 / 8), 4 * plan.t1, 20)]
    )
    k_grid = np.unique(np.round(np.geomspace(1, max(4.0, 4 * plan.k), 16)))
    pairs = [(_steps(plan.t1, step_time), plan.k, plan.replicate), (_steps(two.t1, step_time), two.k, False)]
    pairs += [(t, k, True) for t in t1_grid for k in k_grid]
    t1s, ks, reps = (np.array([p[i] for p in pairs]) for i in range(3))
    waste = simulate_three_level(t1s, ks, reps, levels, work, seeds, restart, rng_seed)
    mean = waste.mean(axis=1)
    best = 2 + int(np.argmin(mean[2:]))
    ci = lambda i: float(1.96 * waste[i].std(ddof=1) / math.sqrt(seeds))
    return {
        "plan_t1": plan.t1,
        "plan_k": float(plan.k),
        "plan_replicate": float(plan.replicate),
        "plan_model": plan.waste,
        "plan": float(mean[0]),
        "plan_ci": ci(0),
        "two_t1": two.t1,
        "two_k": float(two.k),
        "two_model": two.waste,
        "two": float(mean[1]),
        "two_ci": ci(1),
        "best_t1": float(t1s[best]),
        "best_k": float(ks[best]),
        "best": float(mean[best]),
    }


def three_level_table(rows: List[Dict[str, float]]) -> str:
    head = (
        "| failure mix | M1 / M2 / M3 (job) | C1 / D2 (C2) / C3 | three-level T1, k (T3) | waste (sim ± 95% CI) | "
        "model | two-level T1, k (T2) | waste (sim ± 95% CI) | model | two / three | best replicating (T1, k) | "
        "three / best |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['mix']} | {fmt(r['m1'])} / {fmt(r['m2'])} / {fmt(r['m3'])} | {fmt(r['c1'])} / {fmt(r['d2'])} "
            f"({fmt(r['c2'])}) / {fmt(r['c3'])} | {fmt(r['plan_t1'])}, {r['plan_k']:.0f} "
            f"({fmt(r['plan_t1'] * r['plan_k'])}){'' if r['plan_replicate'] else ' no replicas'} | "
            f"{r['plan']:.2%} ± {r['plan_ci']:.2%} | {r['plan_model']:.2%} | {fmt(r['two_t1'])}, {r['two_k']:.0f} "
            f"({fmt(r['two_t1'] * r['two_k'])}) | {r['two']:.2%} ± {r['two_ci']:.2%} | {r['two_model']:.2%} | "
            f"{r['two'] / r['plan']:.2f}x | {fmt(r['best_t1'])}, {r['best_k']:.0f}: {r['best']:.2%} | "
            f"{r['plan'] / r['best']:.3f} |"
        )
    return "\n".join(lines)


def main_three_level(args: argparse.Namespace) -> int:
    step, restart = parse_duration(args.step_time, "--step-time"), parse_duration(args.restart, "--restart")
    costs = [tuple(parse_duration(c, "--costs") for c in spec.split(",")) for spec in args.costs or ["1s,10s,60s"]]
    start, rows = time.perf_counter(), []
    for mix in args.mix or list(MIXES):
        m1, m2, m3 = MIXES[mix]
        for c1, d2, c3 in costs:
            lv = Levels(c1=c1, c2=REPLICA_STEP_OVERHEAD * d2, d2=d2, c3=c3, m1=m1, m2=m2, m3=m3)
            work = args.work_mtbfs / (1.0 / m1 + 1.0 / m2 + 1.0 / m3)
            result = run_three_level(lv, step, work, args.seeds, restart)
            rows.append({"mix": mix, **vars(lv), **result})
    print(three_level_table(rows))
    print(
        f"\n{args.seeds} seeds x {len(rows)} scenarios, work = {args.work_mtbfs:g} x (1/M1 + 1/M2 + 1/M3)^-1 each, "
        f"step {fmt(step)}, restart {fmt(restart)}, C2 = {REPLICA_STEP_OVERHEAD:.0%} of D2; "
        f"{time.perf_counter() - start:.1f} s",
        file=sys.stderr,
    )
    return 0


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
    two = p.add_argument_group("two failure classes (--two-level)")
    two.add_argument("--two-level", action="store_true", help="simulate a memory tier and a durable tier")
    two.add_argument("--m1", action="append", help="job process MTBF(s) M1 (default 1h)")
    two.add_argument("--m2", action="append", help="job node MTBF(s) M2 (default 24h)")
    two.add_argument("--c1", default="0.2s", help="memory snapshot cost C1 (default 0.2s)")
    two.add_argument("--c2", default="10s", help="durable save cost C2 (default 10s)")
    two.add_argument("--measure", action="store_true", help="also measure C1 and C2 here and simulate them first")
    two.add_argument("--state-mb", type=float, default=600.0, help="state size for --measure (default 600 MB)")
    two.add_argument("--durable-dir", default=".", help="where --measure writes the durable saves (default .)")
    two.add_argument("--repeats", type=int, default=5, help="repeats of each --measure timing (default 5)")
    three = p.add_argument_group("three failure classes (--three-level)")
    three.add_argument("--three-level", action="store_true", help="simulate memory, replicas and durable tiers")
    three.add_argument("--mix", action="append", choices=list(MIXES), help="published failure mix(es) (default all)")
    three.add_argument(
        "--costs", action="append", help="C1,D2,C3 (memory, replica transfer, durable); default 1s,10s,60s"
    )
    args = p.parse_args(argv)
    if args.three_level:
        return main_three_level(args)
    if args.two_level:
        return main_two_level(args)

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
