"""The "nodes" of ``tests/helpers/nodes.py`` launched the way ``srun`` launches a job step under SLURM: one
process per rank, no launcher of Lightning's or torch's, each told who it is by SLURM's variables only.

A job of ``num_nodes`` nodes x ``devices`` tasks: rank ``r = node * devices + local`` (SLURM's default block
distribution) gets ``SLURM_NTASKS``, ``SLURM_NTASKS_PER_NODE``, ``SLURM_NNODES``, ``SLURM_PROCID=r``,
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


def task_environment(rank: int, num_nodes: int, per_node: int, job_id: str, port: int) -> dict[str, str]:
    """What ``srun`` tells task ``rank`` of a ``num_nodes`` x ``per_node`` job step (block distribution)."""
    node, local = divmod(rank, per_node)
    nodelist = ",".join([HOST] * num_nodes)
    return {
        "SLURM_JOB_ID": job_id, "SLURM_JOB_NAME": "train", "SLURM_NTASKS": str(num_nodes * per_node),
        "SLURM_NTASKS_PER_NODE": str(per_node), "SLURM_NNODES": str(num_nodes), "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node), "SLURM_NODELIST": nodelist,
        "SLURM_JOB_NODELIST": nodelist, "MASTER_PORT": str(port),
    }  # fmt: skip


def launch(cfg: dict[str, Any], machines: nodes.Cluster, workdir: Path, job_id: str = "4242") -> nodes.Launch:
    """Start every task of ``cfg`` (``num_nodes`` x 1: one process per node, so a node's processes are one
    launch); rank ``r``'s output in ``<out>/node<r>.txt`` (``nodes.output`` reads them)."""
    if int(cfg.get("devices", 1)) != 1:
        raise ValueError("one task per node: nodes.Launch kills a node as one process tree")
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(cfg, distributed_sampler=True)
    cfg_path = out / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    port, bin_dir = free_port(), scontrol(out)
    procs, tokens = [], []
    before = reaper.set_subreaper(True)
    for node in machines.nodes[: cfg["num_nodes"]]:
        token = reaper.new_token()
        env = processes.child_env({
            **runner.trace_environment(kill_resume.trace_dir(cfg), digest_every=1),
            **(cfg.get("env") or {}),
            **task_environment(node.index, cfg["num_nodes"], 1, job_id, port),
            "PATH": f"{bin_dir}:{processes.child_env()['PATH']}",
            nodes.NODE_MEMORY_ENV: str(node.memory),
            reaper.LAUNCH_ENV: token,
        })  # fmt: skip
        for name in LAUNCHER_VARIABLES:
            env.pop(name, None)
        cmd = [sys.executable, str(kill_resume.TRAINEE), str(cfg_path)]
        procs.append(runner.start_process(cmd, workdir, env, out / f"node{node.index}.txt"))
        tokens.append(token)
    return nodes.Launch(cfg, machines, procs, tokens, before)


def run(cfg: dict[str, Any], machines: nodes.Cluster, workdir: Path, timeout: float = 300) -> None:
    """Every task to a clean end; fail with their output otherwise."""
    codes = launch(cfg, machines, workdir).wait(timeout)
    assert codes == [0] * len(codes), f"tasks exited with {codes}:\n{nodes.output(cfg)}"


def run_until_paused(
    cfg: dict[str, Any], machines: nodes.Cluster, workdir: Path, also: Callable[[], bool], also_timeout: float = 120
) -> nodes.Launch:
    """As ``nodes.run_until_paused``: every rank blocked at ``cfg['pause_before']``, then ``also()``."""
    running = launch(cfg, machines, workdir)
    running.ready(lambda: nodes.paused(cfg))
    running.ready(also, timeout=also_timeout)
    return running


def scontrol_calls(cfg: dict[str, Any]) -> list[str]:
    """What the fake ``scontrol`` was asked, one call a line."""
    calls = Path(cfg["out"]) / "scontrol-calls.txt"
    return calls.read_text().splitlines() if calls.exists() else []
