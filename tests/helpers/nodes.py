"""Several "nodes" on this machine: a Lightning DDP fit of ``jobs/trainee.py`` as ``torchrun --nnodes N``
launches on 127.0.0.1, one per node, each node with its own memory tier, and the loss of a node.

A node is one ``torchrun --nnodes N --node-rank i --nproc-per-node P --master-addr 127.0.0.1 --master-port
PORT`` (static rendezvous, no restarts) running the trainee with ``Trainer(num_nodes=N, devices=P,
strategy="ddp")`` on gloo. Each node has its own memory directory (:class:`Cluster`): a tmpfs mounted for it
(``mount -t tmpfs``) where the tests run as root and may mount, else a plain directory of its own under
``/dev/shm``; the trainee puts ``MemoryTierOptions(dir=...)`` there (``NODE_MEMORY_ENV``, set per node
launch), so a rank sees only its own node's memory tier, as on a cluster.

Losing a node (:meth:`Launch.lose`): SIGKILL every process of that node (its torchrun agent and the workers
it started in their own sessions: ``prove.reaper``), then every process of the other nodes (the job dies with
it: the relaunch is a fresh launch of every node), and the node's memory is gone: its tmpfs unmounted and
mounted anew empty, or its directory deleted and made anew (a replacement machine). What the runs trained is
compared as ``kill_resume`` compares it (each rank's step records, its final state, ``prove``'s verdict).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from lightning_resume.format.read import load_file
from lightning_resume.memory.store import MEMORY_KEY, memory_root, slot_key
from lightning_resume.prove import reaper, runner
from lightning_resume.schedule.options import DEFAULT_MEMORY_DIR
from tests.helpers import kill_resume, processes
from tests.helpers.paths import free_port

NODE_MEMORY_ENV = "LIGHTNING_RESUME_TEST_NODE_MEMORY"
"""The node's memory directory, given to its torchrun (and so to its workers): the trainee's memory tier dir."""

TMPFS_SIZE = "256m"
"""Size of each node's tmpfs, where one is mounted."""


@dataclass
class Node:
    """One machine: its index (torchrun's node rank) and its memory directory."""

    index: int
    memory: Path
    mounted: bool

    def wipe(self) -> None:
        """The node is gone and a new one takes its place: its memory is empty."""
        if self.mounted:
            _umount(self.memory)
            _mount(self.memory)
        else:
            shutil.rmtree(self.memory, ignore_errors=True)
            self.memory.mkdir(parents=True)

    def close(self) -> None:
        if self.mounted:
            _umount(self.memory)
        shutil.rmtree(self.memory, ignore_errors=True)


class Cluster:
    """``n`` nodes, each with its own memory directory (a tmpfs mount under ``root`` where allowed)."""

    def __init__(self, root: Path, n: int = 2) -> None:
        self.nodes: list[Node] = []
        self.launches: list[Launch] = []  # killed at close when still running (a test that failed before it did)
        mountable = os.geteuid() == 0 and _mount(root / "probe")
        if mountable:
            _umount(root / "probe")
            for i in range(n):
                _mount(root / f"node{i}")
                self.nodes.append(Node(i, root / f"node{i}", mounted=True))
        else:
            base = Path(DEFAULT_MEMORY_DIR) / f"lightning-resume-test-nodes-{uuid.uuid4().hex[:8]}"
            for i in range(n):
                (base / f"node{i}").mkdir(parents=True)
                self.nodes.append(Node(i, base / f"node{i}", mounted=False))
        self._base = None if mountable else self.nodes[0].memory.parent

    @property
    def mounted(self) -> bool:
        return bool(self.nodes) and self.nodes[0].mounted

    def slot(self, node: int, ckpt_dir: str) -> Path:
        """The directory of a run's memory-tier files on ``node`` (its durable checkpoint directory names it)."""
        return Path(memory_root(str(self.nodes[node].memory))) / slot_key(ckpt_dir)

    def close(self) -> None:
        for running in self.launches:
            if any(proc.poll() is None for proc in running.procs):
                running.kill()
        for node in self.nodes:
            node.close()
        if self._base is not None:
            shutil.rmtree(self._base, ignore_errors=True)


@contextlib.contextmanager
def cluster(root: Path, n: int = 2) -> Iterator[Cluster]:
    machines = Cluster(root, n)
    try:
        yield machines
    finally:
        machines.close()


def _mount(path: Path) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE},mode=0755", "tmpfs", str(path)]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


@dataclass
class Launch:
    """One launch of every node: each node's torchrun, and the token that marks its processes (``reaper``)."""

    cfg: dict[str, Any]
    cluster: Cluster
    procs: list[subprocess.Popen]
    tokens: list[str]
    subreaper_before: bool = False
    ended: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cluster.launches.append(self)

    def wait(self, timeout: float = 300) -> list[int]:
        """Every node's exit code; on timeout every process is killed and the test fails with the output."""
        deadline = time.monotonic() + timeout
        try:
            codes = []
            for proc in self.procs:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            return codes
        except subprocess.TimeoutExpired:
            raise AssertionError(f"launch timed out after {timeout} s:\n{output(self.cfg)}") from None
        finally:
            self.kill()

    def kill_node(self, i: int) -> None:
        """SIGKILL every process of node ``i`` (its torchrun agent, its workers, their data workers)."""
        left = reaper.kill_launch(self.procs[i].pid, self.tokens[i])
        assert not left, f"node {i}: processes survived SIGKILL: {left}"
        self.procs[i].wait(timeout=60)

    def kill(self) -> None:
        for i in range(len(self.procs)):
            self.kill_node(i)
        reaper.set_subreaper(self.subreaper_before)

    def lose(self, node: int) -> None:
        """Node ``node`` is lost: its processes SIGKILLed, then the other nodes' (the job dies), and its memory
        gone (a replacement machine, empty memory)."""
        self.kill_node(node)
        self.kill()
        self.cluster.nodes[node].wipe()

    def ready(self, check: Callable[[], bool], timeout: float = 300) -> None:
        """Wait until ``check()``; fail with the output when a node ends first or ``timeout`` runs out."""
        deadline = time.monotonic() + timeout
        while not check():
            ended = [i for i, p in enumerate(self.procs) if p.poll() is not None]
            if ended or time.monotonic() > deadline:
                self.kill()
                why = f"node(s) {ended} ended" if ended else f"not reached in {timeout} s"
                raise AssertionError(f"kill point {why}:\n{output(self.cfg)}")
            time.sleep(0.05)


def world(cfg: dict[str, Any]) -> int:
    return int(cfg["num_nodes"]) * int(cfg.get("devices", 1))


def launch(cfg: dict[str, Any], machines: Cluster, workdir: Path) -> Launch:
    """Start every node of ``cfg`` (``num_nodes``, ``devices`` per node, the trainee's config; written to
    ``<out>/config.json``); node ``i``'s output in ``<out>/node<i>.txt``, the trace ``prove`` compares in
    ``kill_resume.trace_dir(cfg)``."""
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(cfg, distributed_sampler=True)  # each rank its shard, as with one node of several devices
    cfg_path = out / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    port = free_port()
    procs, tokens = [], []
    before = reaper.set_subreaper(True)  # a worker whose agent died comes back to us: found and killed
    for node in machines.nodes[: cfg["num_nodes"]]:
        token = reaper.new_token()
        env = processes.child_env({
            **runner.trace_environment(kill_resume.trace_dir(cfg), digest_every=1),
            **(cfg.get("env") or {}),
            NODE_MEMORY_ENV: str(node.memory),
            reaper.LAUNCH_ENV: token,
        })  # fmt: skip
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(cfg["num_nodes"]),
            "--node-rank", str(node.index), "--nproc-per-node", str(cfg.get("devices", 1)),
            "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0",
            str(kill_resume.TRAINEE), str(cfg_path),
        ]  # fmt: skip
        procs.append(runner.start_process(cmd, workdir, env, out / f"node{node.index}.txt"))
        tokens.append(token)
    return Launch(cfg, machines, procs, tokens, before)


def output(cfg: dict[str, Any], tail: Optional[int] = 6000) -> str:
    """Every node's output, node by node (the last ``tail`` characters of each)."""
    parts = []
    for path in sorted(Path(cfg["out"]).glob("node*.txt")):
        text = path.read_text(errors="replace")
        parts.append(f"----- {path.name}\n" + (text if tail is None else text[-tail:]))
    return "\n".join(parts)


def run(cfg: dict[str, Any], machines: Cluster, workdir: Path, timeout: float = 300) -> None:
    """Every node to a clean end; fail with their output otherwise."""
    codes = launch(cfg, machines, workdir).wait(timeout)
    assert codes == [0] * len(codes), f"nodes exited with {codes}:\n{output(cfg)}"


def paused(cfg: dict[str, Any]) -> bool:
    """Every rank blocks at ``pause_before`` (the trainee's ``paused-rank<R>``)."""
    return all((Path(cfg["out"]) / f"paused-rank{r}").exists() for r in range(world(cfg)))


def run_until_paused(
    cfg: dict[str, Any],
    machines: Cluster,
    workdir: Path,
    also: Callable[[], bool] = lambda: True,
    also_timeout: float = 120,
) -> Launch:
    """Start every node and wait until every rank blocks at ``cfg['pause_before']``, then until ``also()``
    (what background work, such as replication, must have done by then: ``also_timeout`` s at most); the
    launch, still running, for the test to kill (:meth:`Launch.lose`)."""
    running = launch(cfg, machines, workdir)
    running.ready(lambda: paused(cfg))
    running.ready(also, timeout=also_timeout)
    return running


def memory_step(path: Path) -> Optional[int]:
    """The step of a memory-tier file (a rank's snapshot or a replica of one); ``None`` when absent or unreadable."""
    try:
        return int(load_file(str(path)).checkpoint[MEMORY_KEY]["step"])
    except Exception:  # absent, or damaged: not there (yet)
        return None


def holder(rank: int, world_size: int, num_nodes: int, j: int = 1) -> int:
    """The rank that keeps replica ``j`` of ``rank``'s snapshots: the same local rank ``j`` nodes further round
    the ring of node ranks (the layout the replicated memory tier promises)."""
    per_node = world_size // num_nodes
    node, local = divmod(rank, per_node)
    return ((node + j) % num_nodes) * per_node + local


def snapshot_file(machines: Cluster, ckpt_dir: str, rank: int, world_size: int, num_nodes: int) -> Path:
    """Where ``rank``'s own memory-tier snapshot lives: its node's memory, the run's slot."""
    return machines.slot(rank // (world_size // num_nodes), ckpt_dir) / f"rank-{rank}-of-{world_size}.safetensors"


def replica_file(machines: Cluster, ckpt_dir: str, rank: int, world_size: int, num_nodes: int, j: int = 1) -> Path:
    """Where replica ``j`` of ``rank``'s snapshot lives: on its holder's node (:func:`holder`), the run's slot."""
    node = holder(rank, world_size, num_nodes, j) // (world_size // num_nodes)
    return machines.slot(node, ckpt_dir) / f"replica-{rank}-of-{world_size}.safetensors"


def replicated_at(machines: Cluster, cfg: dict[str, Any], step: int, replicas: int = 1) -> Callable[[], bool]:
    """A check that every rank's snapshot of ``step`` is in its node's memory and its ``replicas`` copies in
    their holders' (each file is renamed into place whole, so one of that step is complete)."""
    w, n = world(cfg), int(cfg["num_nodes"])
    files = [snapshot_file(machines, cfg["ckpt_dir"], r, w, n) for r in range(w)]
    files += [replica_file(machines, cfg["ckpt_dir"], r, w, n, j) for r in range(w) for j in range(1, replicas + 1)]
    return lambda: all(memory_step(path) == step for path in files)
