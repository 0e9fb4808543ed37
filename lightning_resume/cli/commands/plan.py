"""``lightning-resume plan``: the checkpoint interval and expected waste for a model, disk and cluster.

C (the blocking cost of one save) is state bytes / write bandwidth, i.e. a *synchronous* save of
``--size`` parameters at ``--bytes-per-param`` bytes each (default 16: mixed-precision Adam as
counted in the ZeRO paper, 2 B bf16/fp16 weights + 2 B gradients + 12 B fp32 master weights,
momentum and variance; a plain fp32 + Adam checkpoint is 12). With async saves only the host copy
blocks: pass that bandwidth instead, or give ``--cost`` directly. M = per-node MTBF / nodes. The
numbers come from ``lightning_resume.schedule.formulas``; this module only parses, formats and plots.

With ``--process-mtbf`` (M1: failures that keep the node, so a memory-tier snapshot survives them)
it also prints the two-level plan: a memory snapshot every T1 at cost C1 (``--memory-cost``, or the
state bytes over ``--memory-bw``, by default this machine's measured memcpy bandwidth), every k-th
one durable (T2 = k T1), and its expected waste against the single-level optimum that sends every
failure (rate 1/M1 + 1/M2) back to the newest durable save.

With ``--replica-time`` too (D2: how long sending one memory snapshot to a peer node takes, in the
background) it prints the three-level plan of a memory tier with replicas: node losses (``--mtbf``) go
back to the newest replica, whole-job losses (``--job-loss-mtbf``, for the job, not per node) to the
newest durable save; each snapshot is replicated when that pays, every k-th one durable; against the
two-level plan that sends node and job losses to disk.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from typing import Any, Callable, List, Optional, TypedDict

from lightning_resume.durations import parse_duration
from lightning_resume.errors import ConfigurationError
from lightning_resume.schedule.config import DEFAULT_JOB_LOSS_MTBF_PRIOR
from lightning_resume.schedule.formulas import (
    Levels,
    daly_interval,
    expected_waste,
    first_order_waste,
    single_level_waste,
    three_level_plan,
    three_level_waste,
    two_level_plan,
    two_level_waste,
    young_interval,
)
from lightning_resume.schedule.state import REPLICA_STEP_OVERHEAD

_COUNT = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
_BYTES = {
    "B": 1.0,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "TB": 1e12,
    "KIB": 2.0**10,
    "MIB": 2.0**20,
    "GIB": 2.0**30,
    "TIB": 2.0**40,
}


class PlanRow(TypedDict):
    """One point of the waste(T) curve."""

    interval_s: float
    waste: float
    first_order_waste: float
    marks: List[str]


class Plan(TypedDict):
    """What ``compute_plan`` returns (and ``--json`` prints)."""

    cost_s: float
    job_mtbf_s: float
    young_s: float
    young_waste: float
    daly_s: float
    daly_waste: float
    curve: List[PlanRow]


class TwoLevelSummary(TypedDict):
    """The two-level part of ``--json`` (``two_level``): first-order model, job-wide MTBFs."""

    memory_cost_s: float
    process_mtbf_s: float
    node_mtbf_s: float
    t1_s: float
    k: int
    t2_s: float
    waste: float
    single_level_young_s: float
    single_level_waste: float
    ratio: float


class ThreeLevelSummary(TypedDict):
    """The three-level part of ``--json`` (``three_level``): first-order model, job-wide MTBFs."""

    memory_cost_s: float
    replica_time_s: float
    replica_cost_s: float
    durable_cost_s: float
    process_mtbf_s: float
    node_mtbf_s: float
    job_loss_mtbf_s: float
    replicate: bool
    t1_s: float
    k: int
    t3_s: float
    waste: float
    two_level_t1_s: float
    two_level_k: int
    two_level_waste: float
    ratio: float


def parse_count(text: str) -> float:
    """``"7B"``, ``"1.3B"``, ``"125M"``, ``"7e9"`` -> number of parameters."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([KMBGT]?)\s*", str(text), re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"--size={text!r}: use a parameter count like 7B, 1.3B, 125M or 7e9")
    return float(m.group(1)) * _COUNT[m.group(2).upper()]


def parse_bandwidth(text: str) -> float:
    """``"2GB/s"``, ``"500 MB/s"``, ``"1.5GiB/s"`` -> bytes per second (decimal units unless ``iB``)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)(?:/s)?\s*", str(text), re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"--write-bw={text!r}: use a bandwidth like 2GB/s, 500MB/s or 1.5GiB/s")
    return float(m.group(1)) * _BYTES[m.group(2).upper()]


def _duration(name: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = parse_duration(text, name)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{name}={text!r} must be > 0")
        return value

    return parse


def fmt_duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def compute_plan(cost_s: float, job_mtbf_s: float) -> Plan:
    """The plan as plain data: intervals, their waste, and a waste(T) curve around them."""
    young, daly = young_interval(cost_s, job_mtbf_s), daly_interval(cost_s, job_mtbf_s)
    grid = sorted({young * 2.0**k for k in range(-3, 4)} | {daly} | {60.0 * n for n in (5, 15, 30, 60, 120)})
    rows: List[PlanRow] = [
        {
            "interval_s": t,
            "waste": expected_waste(t, cost_s, job_mtbf_s),
            "first_order_waste": first_order_waste(t, cost_s, job_mtbf_s),
            "marks": [n for n, v in (("young", young), ("daly", daly)) if math.isclose(v, t)],
        }
        for t in grid
        if t > 0
    ]
    return {
        "cost_s": cost_s,
        "job_mtbf_s": job_mtbf_s,
        "young_s": young,
        "young_waste": expected_waste(young, cost_s, job_mtbf_s),
        "daly_s": daly,
        "daly_waste": expected_waste(daly, cost_s, job_mtbf_s),
        "curve": rows,
    }


def compute_two_level(
    memory_cost_s: float, durable_cost_s: float, process_mtbf_s: float, node_mtbf_s: float
) -> TwoLevelSummary:
    """The two-level plan and the single-level optimum it replaces, for job-wide MTBFs."""
    plan = two_level_plan(memory_cost_s, durable_cost_s, process_mtbf_s, node_mtbf_s)
    either = 1.0 / (1.0 / process_mtbf_s + 1.0 / node_mtbf_s)
    single = single_level_waste(durable_cost_s, process_mtbf_s, node_mtbf_s)
    return {
        "memory_cost_s": memory_cost_s,
        "process_mtbf_s": process_mtbf_s,
        "node_mtbf_s": node_mtbf_s,
        "t1_s": plan.t1,
        "k": plan.k,
        "t2_s": plan.t2,
        "waste": plan.waste,
        "single_level_young_s": young_interval(durable_cost_s, either),
        "single_level_waste": single,
        "ratio": single / plan.waste if plan.waste > 0 else math.inf,
    }


def format_two_level(two: TwoLevelSummary) -> str:
    return "\n".join(
        [
            "",
            "",
            "two-level: a memory snapshot every T1, every k-th one durable (first-order model)",
            f"C1 (memory snapshot) {fmt_duration(two['memory_cost_s'])}",
            f"M1 (job process MTBF){fmt_duration(two['process_mtbf_s']):>10}   M2 (job node MTBF) "
            f"{fmt_duration(two['node_mtbf_s'])}",
            f"T1 memory interval   {fmt_duration(two['t1_s']):>10}",
            f"k  durable every     {two['k']:>10}   -> T2 durable interval {fmt_duration(two['t2_s'])}",
            f"expected waste       {two['waste']:>10.2%}",
            f"single level         {fmt_duration(two['single_level_young_s']):>10}   expected waste "
            f"{two['single_level_waste']:.2%}  (Young, every failure back to disk)",
            f"two-level saves      {two['ratio']:>9.1f}x   of the single-level waste",
        ]
    )


def compute_three_level(levels: Levels) -> ThreeLevelSummary:
    """The three-level plan and the two-level plan of the same job without replicas."""
    plan, two = three_level_plan(levels), two_level_plan(*levels.without_replicas())
    return {
        "memory_cost_s": levels.c1,
        "replica_time_s": levels.d2,
        "replica_cost_s": levels.c2,
        "durable_cost_s": levels.c3,
        "process_mtbf_s": levels.m1,
        "node_mtbf_s": levels.m2,
        "job_loss_mtbf_s": levels.m3,
        "replicate": plan.replicate,
        "t1_s": plan.t1,
        "k": plan.k,
        "t3_s": plan.t2,
        "waste": plan.waste,
        "two_level_t1_s": two.t1,
        "two_level_k": two.k,
        "two_level_waste": two.waste,
        "ratio": two.waste / plan.waste if plan.waste > 0 else math.inf,
    }


def format_three_level(three: ThreeLevelSummary) -> str:
    replicate = "every memory snapshot" if three["replicate"] else "none: replicas do not pay here"
    return "\n".join(
        [
            "",
            "",
            "three-level: a memory snapshot every T1, sent to a peer node, every k-th one durable (first-order model)",
            f"C1 (memory snapshot) {fmt_duration(three['memory_cost_s']):>10}   C3 (durable save) "
            f"{fmt_duration(three['durable_cost_s'])}",
            f"D2 (replica transfer){fmt_duration(three['replica_time_s']):>10}   C2 (its cost to training, "
            f"{REPLICA_STEP_OVERHEAD:.0%} of D2) {fmt_duration(three['replica_cost_s'])}",
            f"M1 process loss      {fmt_duration(three['process_mtbf_s']):>10}   -> newest memory snapshot",
            f"M2 node loss         {fmt_duration(three['node_mtbf_s']):>10}   -> newest replica (peer node)",
            f"M3 whole-job loss    {fmt_duration(three['job_loss_mtbf_s']):>10}   -> newest durable save",
            f"replicate            {replicate}",
            f"T1 memory interval   {fmt_duration(three['t1_s']):>10}",
            f"k  durable every     {three['k']:>10}   -> T3 durable interval {fmt_duration(three['t3_s'])}",
            f"expected waste       {three['waste']:>10.2%}",
            f"two-level            {fmt_duration(three['two_level_t1_s']):>10}   k {three['two_level_k']}, expected waste "
            f"{three['two_level_waste']:.2%}  (no replicas: node and job losses back to disk)",
            f"replicas save        {three['ratio']:>9.1f}x   of the two-level waste",
        ]
    )


def measure_memcpy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 3) -> float:
    """This machine's memcpy bandwidth (bytes/s): the best of ``repeats`` copies of ``nbytes`` into a
    preallocated buffer, roughly what a memory-tier snapshot costs per byte."""
    src, dst = bytearray(nbytes), bytearray(nbytes)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        dst[:] = src
        best = min(best, time.perf_counter() - start)
    return nbytes / max(best, 1e-9)


def format_plan(plan: Plan, header: List[str]) -> str:
    lines = header + [
        f"C (blocking cost)    {fmt_duration(plan['cost_s'])}",
        f"M (job MTBF)         {fmt_duration(plan['job_mtbf_s'])}",
        f"T* Young sqrt(2CM)   {fmt_duration(plan['young_s']):>10}   expected waste {plan['young_waste']:.2%}",
        f"T* Daly              {fmt_duration(plan['daly_s']):>10}   expected waste {plan['daly_waste']:.2%}",
        "",
        "interval T    waste (Poisson, exact)   C/T + T/2M",
    ]
    for row in plan["curve"]:
        mark = "  <- " + ", ".join(row["marks"]) if row["marks"] else ""
        lines.append(
            f"{fmt_duration(row['interval_s']):>10}    {row['waste']:>10.2%}   {row['first_order_waste']:>18.2%}{mark}"
        )
    lines.append("waste = expected fraction of wall time lost to saves and redone work, exponential failures.")
    return "\n".join(lines)


def write_plot(plan: Plan, path: str, three: Optional[ThreeLevelSummary] = None) -> Optional[str]:
    """Write the waste(T) curve as a PNG; return an error message instead if matplotlib is missing. With
    ``three``, a second panel: the first-order waste against T1 of the two- and three-level plans, each at
    its own k."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot needs matplotlib, which is not installed: pip install matplotlib (the table above is complete)"
    c, m = plan["cost_s"], plan["job_mtbf_s"]
    lo, hi = plan["young_s"] / 10, plan["young_s"] * 10
    ts = [lo * (hi / lo) ** (i / 199) for i in range(200)]
    fig, axes = plt.subplots(1, 1 if three is None else 2, figsize=(6 if three is None else 12, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot([t / 60 for t in ts], [100 * expected_waste(t, c, m) for t in ts], label="expected waste")
    for name, t in (("young", plan["young_s"]), ("daly", plan["daly_s"])):
        ax.axvline(t / 60, linestyle="--", color="C1" if name == "young" else "C2", label=f"{name} {fmt_duration(t)}")
    ax.set(
        xscale="log",
        xlabel="checkpoint interval T (min)",
        ylabel="waste (% of wall time)",
        title=f"C = {fmt_duration(c)}, M = {fmt_duration(m)}",
    )
    ax.legend()
    if three is not None:
        _plot_levels(axes[0][1], three)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _plot_levels(ax: Any, three: ThreeLevelSummary) -> None:
    """Waste against T1: two-level (no replicas) and three-level, each at its plan's k."""
    levels = _levels_of(three)
    two_args = levels.without_replicas()
    lo, hi = min(three["t1_s"], three["two_level_t1_s"]) / 10, max(three["t1_s"], three["two_level_t1_s"]) * 10
    ts = [lo * (hi / lo) ** (i / 199) for i in range(200)]
    k2, k3 = three["two_level_k"], three["k"]
    ax.plot([t / 60 for t in ts], [100 * two_level_waste(t, k2, *two_args) for t in ts], label=f"two-level, k={k2}")
    if three["replicate"]:
        ax.plot(
            [t / 60 for t in ts], [100 * three_level_waste(t, k3, levels) for t in ts], label=f"three-level, k={k3}"
        )
    for name, t, color in (("two-level", three["two_level_t1_s"], "C0"), ("three-level", three["t1_s"], "C1")):
        ax.axvline(t / 60, linestyle="--", color=color, label=f"{name} T1 {fmt_duration(t)}")
    ax.set(xscale="log", xlabel="memory interval T1 (min)", ylabel="waste (% of wall time, first order)")
    ax.set_title(f"replicas: D2 = {fmt_duration(three['replica_time_s'])}, saves {three['ratio']:.1f}x")
    ax.legend(fontsize=8)


def _levels_of(three: ThreeLevelSummary) -> Levels:
    return Levels(
        c1=three["memory_cost_s"],
        c2=three["replica_cost_s"],
        d2=three["replica_time_s"],
        c3=three["durable_cost_s"],
        m1=three["process_mtbf_s"],
        m2=three["node_mtbf_s"],
        m3=three["job_loss_mtbf_s"],
    )


def run(args: argparse.Namespace) -> int:
    if args.cost is None and (args.size is None or args.write_bw is None):
        raise ConfigurationError("lightning-resume plan", ["give --size and --write-bw (or --cost)"])
    header = []
    if args.cost is not None:
        cost = args.cost
    else:
        nbytes = args.size * args.bytes_per_param
        cost = nbytes / args.write_bw
        header.append(
            f"state                {args.size / 1e9:.3g}B params x {args.bytes_per_param:g} B = {nbytes / 1e9:.1f} GB "
            f"at {args.write_bw / 1e9:.2f} GB/s (synchronous save)"
        )
    plan = compute_plan(cost, args.mtbf / args.nodes)
    header.append(f"nodes                {args.nodes} x MTBF {fmt_duration(args.mtbf)} per node")
    two = _two_level(args, cost)
    three = _three_level(args, cost, two)
    if args.json:
        print(json.dumps({**plan, "two_level": two, "three_level": three}, indent=1))
    else:
        tiers = ("" if two is None else format_two_level(two)) + ("" if three is None else format_three_level(three))
        print(format_plan(plan, header) + tiers)
    if args.plot:
        error = write_plot(plan, args.plot, three)
        if error:
            raise ConfigurationError("lightning-resume plan", [error])
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def _two_level(args: argparse.Namespace, durable_cost: float) -> Optional[TwoLevelSummary]:
    if args.process_mtbf is None:
        return None
    memory_cost = args.memory_cost
    if memory_cost is None:
        if args.size is None:
            raise ConfigurationError(
                "lightning-resume plan", ["--process-mtbf needs --memory-cost, or --size to derive it from memcpy"]
            )
        bandwidth = args.memory_bw if args.memory_bw is not None else measure_memcpy_bandwidth()
        memory_cost = args.size * args.bytes_per_param / bandwidth
    return compute_two_level(memory_cost, durable_cost, args.process_mtbf / args.nodes, args.mtbf / args.nodes)


def _three_level(
    args: argparse.Namespace, durable_cost: float, two: Optional[TwoLevelSummary]
) -> Optional[ThreeLevelSummary]:
    if args.replica_time is None:
        return None
    if two is None:
        raise ConfigurationError(
            "lightning-resume plan", ["--replica-time needs --process-mtbf (the memory tier's M1)"]
        )
    d2 = args.replica_time
    levels = Levels(
        c1=two["memory_cost_s"],
        c2=REPLICA_STEP_OVERHEAD * d2,
        d2=d2,
        c3=durable_cost,
        m1=two["process_mtbf_s"],
        m2=two["node_mtbf_s"],
        m3=args.job_loss_mtbf,
    )
    return compute_three_level(levels)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan", help="optimal checkpoint interval (Young/Daly) and expected waste", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--size", type=parse_count, help="parameters, e.g. 7B, 125M")
    p.add_argument("--write-bw", type=parse_bandwidth, help="checkpoint write bandwidth, e.g. 2GB/s")
    p.add_argument("--bytes-per-param", type=float, default=16.0, help="checkpoint bytes per parameter (default 16)")
    p.add_argument("--cost", type=_duration("--cost"), help="blocking cost C of one save, instead of size/bandwidth")
    p.add_argument("--mtbf", type=_duration("--mtbf"), default=86400.0, help="MTBF of one node (default 24h)")
    p.add_argument("--nodes", type=int, default=1, help="nodes in the job (default 1)")
    p.add_argument(
        "--process-mtbf",
        type=_duration("--process-mtbf"),
        help="mean time between process failures that keep the node (M1, per node): adds the two-level plan",
    )
    p.add_argument("--memory-cost", type=_duration("--memory-cost"), help="blocking cost C1 of a memory snapshot")
    p.add_argument(
        "--memory-bw",
        type=parse_bandwidth,
        help="host memcpy bandwidth for C1 = size / bw (default: measured here)",
    )
    p.add_argument(
        "--replica-time",
        type=_duration("--replica-time"),
        help="time D2 to send one memory snapshot to a peer node (background): adds the three-level plan",
    )
    p.add_argument(
        "--job-loss-mtbf",
        type=_duration("--job-loss-mtbf"),
        default=parse_duration(DEFAULT_JOB_LOSS_MTBF_PRIOR),
        help=f"mean time between whole-job losses (M3, for the job; default {DEFAULT_JOB_LOSS_MTBF_PRIOR})",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", metavar="PNG", help="also write the waste(T) curve (needs matplotlib)")
    p.set_defaults(func=run)
