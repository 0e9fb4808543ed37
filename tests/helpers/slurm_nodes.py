"""The "nodes" of ``tests/helpers/nodes.py`` launched the way ``srun`` launches a job step under SLURM: one
process per rank (started by a shell per node, as ``slurmstepd`` starts a node's tasks), no launcher of
Lightning's or torch's, each told who it is by SLURM's variables only.

A job of ``num_nodes`` nodes x ``devices`` tasks: rank ``r`` (``r = node * devices + local`` in SLURM's
default block distribution, ``r = local * num_nodes + node`` in the cyclic one) gets ``SLURM_NTASKS``, ``SLURM_NTASKS_PER_NODE``, ``SLURM_NNODES``, ``SLURM_PROCID=r``,
``SLURM_LOCALID=local``, ``SLURM_NODEID=node``, ``SLURM_JOB_ID``, ``SLURM_JOB_NAME``, the node list
(``SLURM_NODELIST``/``SLURM_JOB_NODELIST``: ``localhost`` for every node, the name that resolves to
127.0.0.1 on any machine) and ``MASTER_PORT`` (a free port: what a job script exports, else Lightning derives
one from the job id), and no ``MASTER_ADDR``: Lightning's ``SLURMEnvironment`` takes it from the node list.
A fake ``scontrol`` first on ``PATH`` records any call in ``<out>/scontrol-calls.txt``. Each node's memory
directory is its own (``nodes.NODE_MEMORY_ENV``), its processes carry one launch token, so
:meth:`nodes.Launch.lose` kills a node and wipes its memory as it does for torchrun nodes.
"""

from __future__ import annotations

import json
import shlex
import stat
import sys
from pathlib import Path
from typing import Any, Callable

from lightning_resume.prove import reaper, runner
from tests.helpers import kill_resume, nodes, processes
from tests.helpers.paths import free_port

HOST = "localhost"
"""Every node's name in the node list: resolves to 127.0.0.1."""

LAUNCHER_VARIABLES = ("MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")
"""Set by other launchers (torchrun, Lightning's own): never in a SLURM task's environment here."""


def scontrol(out: Path) -> Path:
    """A directory with a fake ``scontrol`` that appends its arguments to ``<out>/scontrol-calls.txt``."""
    bin_dir = out / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    fake = bin_dir / "scontrol"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {out / "scontrol-calls.txt"}\nexit 0\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def ranks_on(node: int, num_nodes: int, per_node: int, distribution: str = "block") -> list[int]:
    """The ranks ``srun`` puts on ``node``, by local rank: node by node (``block``, SLURM's default) or dealt
    round the nodes (``cyclic``: rank r on node r % num_nodes)."""
    if distribution == "cyclic":
        return [local * num_nodes + node for local in range(per_node)]
    return [node * per_node + local for local in range(per_node)]


def node_environment(node: int, num_nodes: int, per_node: int, job_id: str, port: int) -> dict[str, str]:
    """What ``srun`` tells every task of ``node`` in a ``num_nodes`` x ``per_node`` job step."""
    nodelist = ",".join([HOST] * num_nodes)
    return {
        "SLURM_JOB_ID": job_id, "SLURM_JOB_NAME": "train", "SLURM_NTASKS": str(num_nodes * per_node),
        "SLURM_NTASKS_PER_NODE": str(per_node), "SLURM_NNODES": str(num_nodes), "SLURM_NODEID": str(node),
        "SLURM_NODELIST": nodelist, "SLURM_JOB_NODELIST": nodelist, "MASTER_PORT": str(port),
    }  # fmt: skip


def step_daemon(ranks: list[int], cfg_path: Path) -> list[str]:
    """A node's stand-in for ``slurmstepd``: a shell that starts the node's tasks (``SLURM_PROCID``,
    ``SLURM_LOCALID`` each) and waits for them; the first to fail ends it with its code."""
    task = f"{shlex.quote(sys.executable)} {shlex.quote(str(kill_resume.TRAINEE))} {shlex.quote(str(cfg_path))}"
    starts = [f"SLURM_PROCID={r} SLURM_LOCALID={local} {task} & t{local}=$!" for local, r in enumerate(ranks)]
    waits = " && ".join(f"wait $t{local}" for local in range(len(ranks)))
    return ["sh", "-c", "; ".join([*starts, waits])]


def launch(
    cfg: dict[str, Any], machines: nodes.Cluster, workdir: Path, job_id: str = "4242", distribution: str = "block"
) -> nodes.Launch:
    """Start every node of ``cfg`` (``num_nodes`` x ``devices`` tasks, placed by ``distribution``): one step
    daemon per node, its tasks' output in ``<out>/node<i>.txt`` (``nodes.output`` reads them)."""
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(cfg, distributed_sampler=True)
    cfg_path = out / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    port, bin_dir = free_port(), scontrol(out)
    num_nodes, per_node = int(cfg["num_nodes"]), int(cfg.get("devices", 1))
    procs, tokens = [], []
    before = reaper.set_subreaper(True)
    for node in machines.nodes[:num_nodes]:
        token = reaper.new_token()
        env = processes.child_env({
            **runner.trace_environment(kill_resume.trace_dir(cfg), digest_every=1),
            **(cfg.get("env") or {}),
            **node_environment(node.index, num_nodes, per_node, job_id, port),
            "PATH": f"{bin_dir}:{processes.child_env()['PATH']}",
            nodes.NODE_MEMORY_ENV: str(node.memory),
            reaper.LAUNCH_ENV: token,
        })  # fmt: skip
        for name in LAUNCHER_VARIABLES:
            env.pop(name, None)
        cmd = step_daemon(ranks_on(node.index, num_nodes, per_node, distribution), cfg_path)
        procs.append(runner.start_process(cmd, workdir, env, out / f"node{node.index}.txt"))
        tokens.append(token)
    return nodes.Launch(cfg, machines, procs, tokens, before)


def run(cfg: dict[str, Any], machines: nodes.Cluster, workdir: Path, distribution: str = "block") -> None:
    """Every task to a clean end; fail with their output otherwise."""
    codes = launch(cfg, machines, workdir, distribution=distribution).wait(300)
    assert codes == [0] * len(codes), f"tasks exited with {codes}:\n{nodes.output(cfg)}"


def run_until_paused(
    cfg: dict[str, Any], machines: nodes.Cluster, workdir: Path, also: Callable[[], bool], distribution: str = "block"
) -> nodes.Launch:
    """As ``nodes.run_until_paused``: every rank blocked at ``cfg['pause_before']``, then ``also()``."""
    running = launch(cfg, machines, workdir, distribution=distribution)
    running.ready(lambda: nodes.paused(cfg))
    running.ready(also, timeout=120)
    return running


def scontrol_calls(cfg: dict[str, Any]) -> list[str]:
    """What the fake ``scontrol`` was asked, one call a line."""
    calls = Path(cfg["out"]) / "scontrol-calls.txt"
    return calls.read_text().splitlines() if calls.exists() else []
