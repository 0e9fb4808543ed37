"""The replicated memory tier across real "nodes" (``tests/helpers/nodes.py``: one ``torchrun --nnodes N
--node-rank i`` per node on 127.0.0.1, each node its own tmpfs, DDP on gloo). Run B is SIGKILLed between
durable saves (disk: step 6, memory: step 8, every snapshot replicated to the next node round the ring),
then a node is lost: its processes killed, its memory gone, the job relaunched on every node.

- The lost node's ranks get their step-8 snapshots from the peer that holds their replicas, and the run goes
  on bit for bit (every step's loss bits, every rank's final state, ``prove``'s verdict) against the
  uninterrupted run A; the resume report says tier "replica" and which rank's memory held each rank's state;
  with the durable checkpoints on the S3 test server, the bytes of every object the relaunch read before its
  first step are counted (a WSGI middleware on moto): none beyond the file's header, no tensor bytes.
- A node lost while its newest replica is still in transit (held back on its way, test-side) resumes from the
  newest complete set in memory, the anchor (save of step 8, kept by the survivor while step 10's replica was
  on its way), bit for bit, reading no durable tensor byte; without room to keep that save, from disk.
- A replica damaged in the holder's memory is refused by its digest, named, and the run resumes from disk,
  bit for bit; so does a run that lost a node and the holder of its replicas, saying why in one line; and a
  run without replicas (``replicas=0``)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import struct
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import fsspec
import pytest

from lightning_resume.schedule.options import DEFAULT_MEMORY_DIR
from lightning_resume.testing import assert_resumes_exactly
from tests.helpers import kill_resume as h
from tests.helpers import nodes, slurm_nodes
from tests.helpers.paths import JOBS_DIR
from tests.helpers.s3 import s3_env

PROVE_TARGET = JOBS_DIR / "prove_target.py"

EXTENDED = frozenset(
    {
        "test_a_node_lost_resumes_from_the_peers_replica_exactly[2x2]",
        "test_a_node_lost_without_replicas_resumes_from_disk_exactly",
        "test_a_node_and_the_holder_of_its_replicas_lost_resume_from_disk_in_one_line[3x1]",
        "test_prove_is_unchanged_on_a_two_node_script_with_the_replicated_tier",
        "test_a_node_lost_under_slurm_resumes_from_the_peers_replica_exactly",
        "test_a_node_lost_mid_transfer_without_room_to_keep_resumes_from_disk",
    }
)
"""In make test-all only: 2 nodes x 2 ranks (the same path with two local ranks per node: each rank's replica
on the same local rank of the peer), replicas=0 (the fallback to disk, as losing the holder too does), and three
nodes (a survivor whose memory is not enough; three fresh launches of three nodes), and ``prove`` on a two-node
script (test_prove_torchrun.py covers ``prove`` of torchrun in make test), and the control of the node lost mid-transfer
(no room to keep a save: the same fallback to disk as without replicas)."""

DURABLE_EVERY, MEMORY_EVERY, KILL_AT = 6, 2, 9
"""Durable snapshots every 6 steps, memory ones every 2: killed at step 9, disk has step 6, memory step 8."""

pytestmark = pytest.mark.timeout(900)


def _cfg(tmp_path: Path, num_nodes: int, devices: int, **memory: Any) -> dict[str, Any]:
    memory = {"every_n_train_steps_max": MEMORY_EVERY, **memory}
    exact = {"schedule": {"every_n_train_steps_max": DURABLE_EVERY}, "memory_tier": memory}
    return {
        "n": 40 * num_nodes * devices, "batch_size": 4, "max_epochs": 2, "dropout": 0.2, "augment": True,
        "shuffle": True, "num_nodes": num_nodes, "devices": devices, "safetensors": True, "ckpt": {"save_top_k": 0},
        "exact_args": exact, "ckpt_dir": str(tmp_path / "ckpt"), "flush_memory_tier": True, "wait_replicated": True,
    }  # fmt: skip


@pytest.fixture
def machines(tmp_path: Path) -> Iterator[nodes.Cluster]:
    with nodes.cluster(tmp_path / "machines", 3) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, int], Path]:
    """Run A of a topology (nodes, ranks per node), once per module: the whole fit, replicated, on its own
    machines; its output directory."""
    done: dict[tuple[int, int], Path] = {}

    def reference(num_nodes: int, devices: int) -> Path:
        if (num_nodes, devices) not in done:
            root = tmp_path_factory.mktemp(f"A{num_nodes}x{devices}")
            with nodes.cluster(root / "machines", num_nodes) as cluster:
                a = dict(_cfg(root, num_nodes, devices), out=str(root / "A"))
                nodes.run(a, cluster, root)
                leftovers = [p for i in range(num_nodes) for p in cluster.slot(i, a["ckpt_dir"]).glob("*")]
                assert not leftovers, f"a clean end of training frees the memory tier: {leftovers}"
            done[(num_nodes, devices)] = root / "A"
        return done[(num_nodes, devices)]

    return reference


def _killed(cfg: dict[str, Any], machines: nodes.Cluster, tmp_path: Path, replicas: int = 1) -> nodes.Launch:
    """Run B, paused before step ``KILL_AT`` once every rank's step-8 snapshot and its replicas are in memory."""
    b = dict(cfg, out=str(tmp_path / "B"), pause_before=KILL_AT)
    return nodes.run_until_paused(b, machines, tmp_path, nodes.replicated_at(machines, b, 8, replicas))


def _resume(
    cfg: dict[str, Any], machines: nodes.Cluster, tmp_path: Path, reads: Optional[ObjectReads] = None
) -> dict[str, Any]:
    """Run C: every node relaunched, ``fit(ckpt_path="last")``. ``reads``: counts the object reads of the
    resume (until the first training step is recorded: a later durable save is not the resume)."""
    c = dict(cfg, out=str(tmp_path / "C"), resume="last")
    if reads is not None:
        reads.count(lambda: not (tmp_path / "C" / "steps-rank0.jsonl").exists())
    nodes.run(c, machines, tmp_path)
    return c


def _report(c: dict[str, Any], rank: int = 0) -> dict[str, Any]:
    return json.loads((Path(c["out"]) / f"report-rank{rank}.json").read_text())


class ObjectReads:
    """What the S3 server sent in answer to object GETs (listings aside) while ``counting()``: ``(key, first
    byte, bytes)`` each."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, int, int]] = []
        self.counting: Callable[[], bool] = lambda: False

    def count(self, counting: Callable[[], bool]) -> None:
        """From now on, count the reads that arrive while ``counting()``, in a new list (a read that arrived
        before, whose body the server is still finishing, goes to the old one)."""
        self.reads, self.counting = [], counting

    def wrap(self, app):
        def middleware(environ, start_response):
            body = app(environ, start_response)
            _, _, key = environ.get("PATH_INFO", "").lstrip("/").partition("/")
            if environ.get("REQUEST_METHOD") != "GET" or not key or not self.counting():
                return body
            first = re.match(r"bytes=(\d+)-", environ.get("HTTP_RANGE", ""))
            return self._counted(body, key, int(first.group(1)) if first else 0, self.reads)

        return middleware

    @staticmethod
    def _counted(body, key: str, first: int, into: list):
        sent = 0
        try:
            for chunk in body:
                sent += len(chunk)
                yield chunk
        finally:
            into.append((key, first, sent))
            if hasattr(body, "close"):
                body.close()


@pytest.fixture
def object_reads(s3_server) -> Iterator[ObjectReads]:
    with s3_server.watched(ObjectReads()) as counter:
        yield counter


def _header_ends(bucket: str) -> dict[str, int]:
    """Where the data of each file in ``bucket`` starts (8 + its safetensors header's length), by key."""
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    ends = {}
    for path in fs.find(bucket):
        ends[path[len(bucket) + 1 :]] = 8 + struct.unpack("<Q", fs.cat_file(path, start=0, end=8))[0]
    return ends


def _beyond_headers(reads: list[tuple[str, int, int]], ends: dict[str, int]) -> list[tuple[str, int, int]]:
    """The reads of a durable file the relaunch found (``ends``) that went past its header. (Files the relaunch
    wrote itself, read back to verify them, are not the state it resumed from.)"""
    return [(key, first, n) for key, first, n in reads if key in ends and first + n > ends[key]]


def _assert_exact(a: Path, c: dict[str, Any], resumed_after: int, ranks: int) -> None:
    """``kill_resume.assert_exact_resume``, on any number of ranks (DDP's bucket layout is resumed too)."""
    h.assert_exact_resume(a, Path(c["out"]), resumed_after=resumed_after, ranks=ranks)


@pytest.mark.parametrize("devices", [1, 2], ids=["2x1", "2x2"])
def test_a_node_lost_resumes_from_the_peers_replica_exactly(
    tmp_path: Path, machines: nodes.Cluster, uninterrupted, s3_bucket: str, s3_server, object_reads, devices: int
) -> None:
    a = uninterrupted(2, devices)
    env = s3_env(s3_server.endpoint)
    cfg = dict(_cfg(tmp_path, 2, devices), ckpt_dir=f"{s3_bucket}/run", env=env)
    _killed(cfg, machines, tmp_path).lose(1)
    world = 2 * devices
    lost = list(range(devices, world))  # node 1's ranks
    assert not list(machines.nodes[1].memory.iterdir()), "node 1 was replaced: its memory is empty"
    bucket = s3_bucket[len("s3://") :]
    ends = _header_ends(bucket)  # the durable files the relaunch finds
    c = _resume(cfg, machines, tmp_path, object_reads)
    reads = list(object_reads.reads)
    # node 0's ranks: their own memory; node 1's: the same local rank of node 0, which held their replicas (the ring)
    sources = _report(c)["memory_sources"]
    assert sources == list(range(devices)) * 2, sources
    for rank in range(world):
        report = _report(c, rank)
        assert (report["tier"], report["memory_sources"]) == ("replica", sources), report
    out = nodes.output(c, tail=None)
    for r in lost:
        assert f"rank {r}'s state from rank {sources[r]}'s memory" in out, f"the log names rank {r}'s source:\n{out}"
    assert not _beyond_headers(reads, ends), f"durable bytes beyond a header were read: {reads} (headers: {ends})"
    _assert_exact(a, c, 8, world)


def test_a_replica_damaged_on_the_peer_is_refused_and_the_run_resumes_from_disk(
    tmp_path: Path, machines: nodes.Cluster, uninterrupted, s3_bucket: str, s3_server, object_reads
) -> None:
    """Also the counter's check: this resume reads the durable checkpoint's tensors, and they are counted."""
    a = uninterrupted(2, 1)
    cfg = dict(_cfg(tmp_path, 2, 1), ckpt_dir=f"{s3_bucket}/run", env=s3_env(s3_server.endpoint))
    _killed(cfg, machines, tmp_path).lose(1)
    replica = nodes.replica_file(machines, cfg["ckpt_dir"], 1, 2, 2)
    data = bytearray(replica.read_bytes())
    data[-5] ^= 0x01  # a tensor byte: only the digest can tell
    replica.write_bytes(bytes(data))
    ends = _header_ends(s3_bucket[len("s3://") :])
    c = _resume(cfg, machines, tmp_path, object_reads)
    assert _beyond_headers(object_reads.reads, ends), "the durable checkpoint's tensors were read, and counted"
    h.assert_exact_resume(a, Path(c["out"]), resumed_after=DURABLE_EVERY, ranks=2)
    assert _report(c)["tier"] == "durable"
    out = nodes.output(c, tail=None)
    assert str(replica) in out and "checksum mismatch" in out, out


@pytest.mark.parametrize("num_nodes", [2, 3], ids=["2x1", "3x1"])
def test_a_node_and_the_holder_of_its_replicas_lost_resume_from_disk_in_one_line(
    tmp_path: Path, machines: nodes.Cluster, uninterrupted, num_nodes: int
) -> None:
    """Node 1 and node 2, the holder of node 1's replicas, are lost. On two nodes that is every node (node 0 held
    node 1's replicas); on three, node 0 keeps its own snapshot and node 2's replica, not enough: every rank
    resumes from disk together, and one line says why."""
    a = uninterrupted(num_nodes, 1)
    cfg = _cfg(tmp_path, num_nodes, 1)
    _killed(cfg, machines, tmp_path).lose(1)
    machines.nodes[2 % num_nodes].wipe()
    c = _resume(cfg, machines, tmp_path)
    assert [_report(c, r)["tier"] for r in range(num_nodes)] == ["durable"] * num_nodes
    lines = [line for line in nodes.output(c, tail=None).splitlines() if "not resuming from the memory tier" in line]
    assert len(lines) == 1 and lines[0].endswith("last-snapshot-step=000000006.ckpt"), lines
    if num_nodes == 3:
        assert "no replica of rank 1's state on any rank" in lines[0], lines
    _assert_exact(a, c, DURABLE_EVERY, num_nodes)


def test_a_node_lost_without_replicas_resumes_from_disk_exactly(
    tmp_path: Path, machines: nodes.Cluster, uninterrupted
) -> None:
    a = uninterrupted(2, 1)
    cfg = _cfg(tmp_path, 2, 1, replicas=0)
    _killed(cfg, machines, tmp_path, replicas=0).lose(1)
    c = _resume(cfg, machines, tmp_path)
    h.assert_exact_resume(a, Path(c["out"]), resumed_after=DURABLE_EVERY, ranks=2)
    assert "no verified snapshot on rank(s) [1]" in nodes.output(c, tail=None)


HELD_AT, PAUSE_MID_TRANSFER = 10, 11
"""Rank 1's replica of its step-10 snapshot never arrives (its transfer is held on rank 1); paused before step 11."""


def _in_transit(cfg: dict[str, Any], machines: nodes.Cluster, tmp_path: Path, **b: Any) -> nodes.Launch:
    """Run B, paused before step 11: every rank's step-10 snapshot in its node's memory, rank 0's replica of it on
    node 1, rank 1's still in transit (node 0 holds its replica of step 8). Each memory save waits for the previous
    transfer (``wait_replicated``), so every rank's gate finds every replicator idle and both replicate each save."""
    b = dict(cfg, out=str(tmp_path / "B"), pause_before=PAUSE_MID_TRANSFER, **b)
    b["hold_replica"] = {"rank": 1, "step": HELD_AT}
    step = lambda rank, file: nodes.memory_step(file(machines, b["ckpt_dir"], rank, 2, 2))
    there = lambda: (
        [step(r, nodes.snapshot_file) for r in (0, 1)] == [HELD_AT, HELD_AT]
        and [step(r, nodes.replica_file) for r in (0, 1)] == [HELD_AT, 8]
    )
    return nodes.run_until_paused(b, machines, tmp_path, there)


def _kept_steps(machines: nodes.Cluster, ckpt_dir: str, node: int) -> list[Optional[int]]:
    """The steps of the saves node ``node`` keeps of its rank's own snapshot (``rank-<r>-of-2.keep-<seq>``)."""
    return sorted(nodes.memory_step(f) or -1 for f in machines.slot(node, ckpt_dir).glob(f"rank-{node}-of-2.keep-*"))


def test_a_node_lost_mid_transfer_resumes_from_the_newest_complete_set_exactly(
    tmp_path: Path, machines: nodes.Cluster, uninterrupted, s3_bucket: str, s3_server, object_reads
) -> None:
    """Node 1 is lost while rank 1's step-10 replica is on its way: node 0 has its own step 10 and rank 1's step 8.
    Step 8 is the anchor: node 0 kept its own step-8 snapshot, so every rank resumes at step 8 from node 0's memory
    (rank 0 from its kept save, rank 1 from its replica), not from the durable step 6."""
    a = uninterrupted(2, 1)
    cfg = dict(_cfg(tmp_path, 2, 1), ckpt_dir=f"{s3_bucket}/run", env=s3_env(s3_server.endpoint))
    running = _in_transit(cfg, machines, tmp_path)
    assert 8 in _kept_steps(machines, cfg["ckpt_dir"], 0), "node 0 keeps its step-8 snapshot: the anchor"
    running.lose(1)
    ends = _header_ends(s3_bucket[len("s3://") :])
    c = _resume(cfg, machines, tmp_path, object_reads)
    reads = list(object_reads.reads)
    for rank in (0, 1):
        report = _report(c, rank)
        assert (report["tier"], report.get("memory_sources")) == ("replica", [0, 0]), report
    out = nodes.output(c, tail=None)
    assert "resuming from the memory tier at step 8 (durable: step 6); rank 1's state from rank 0's memory" in out, out
    assert not _beyond_headers(reads, ends), f"durable bytes beyond a header were read: {reads} (headers: {ends})"
    _assert_exact(a, c, 8, 2)


def test_a_node_lost_mid_transfer_without_room_to_keep_resumes_from_disk(
    tmp_path: Path, machines: nodes.Cluster, uninterrupted
) -> None:
    """The control: the memory tiers look too small to keep a save (``no_room_to_keep``), so none is kept, said once
    with the sizes; the same loss finds rank 1's state only at step 8 and rank 0's only at 10: from disk, exact."""
    a = uninterrupted(2, 1)
    cfg = _cfg(tmp_path, 2, 1)
    running = _in_transit(cfg, machines, tmp_path, no_room_to_keep=True)
    assert _kept_steps(machines, cfg["ckpt_dir"], 0) == []
    said = nodes.output(running.cfg, tail=None)
    assert said.count("no save is kept") == 1 and "free, less than the" in said, said
    running.lose(1)
    c = _resume(cfg, machines, tmp_path)
    assert [_report(c, r)["tier"] for r in (0, 1)] == ["durable"] * 2
    assert "rank 1's state is missing: only step 8" in nodes.output(c, tail=None) and "on rank(s) [0]" in nodes.output(
        c, tail=None
    )
    _assert_exact(a, c, DURABLE_EVERY, 2)


def test_prove_is_unchanged_on_a_two_node_script_with_the_replicated_tier(tmp_path: Path) -> None:
    """``lightning-resume prove`` on a launch of two torchrun nodes (one shell command, the nodes' memory tiers
    in one tmpfs directory of this machine): it kills the whole launch at a step it draws and relaunches it;
    the relaunch resumes from the memory tier (a snapshot every step), replicated underneath, and the verdict
    is EXACT."""
    shm = Path(DEFAULT_MEMORY_DIR) / f"lightning-resume-test-prove-{tmp_path.name[-8:]}"
    node = (
        f"{shlex.quote(sys.executable)} -m torch.distributed.run --nnodes 2 --node-rank $i --nproc-per-node 1"
        " --master-addr 127.0.0.1 --master-port $port --max-restarts 0"
        f" {shlex.quote(str(PROVE_TARGET))} --num_nodes 2 --max_steps 16 --memory_dir {shlex.quote(str(shm))}"
    )
    bind = "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
    free = f"{shlex.quote(sys.executable)} -c {shlex.quote(bind)}"
    script = f"port=$({free}); i=0; {node} & a=$!; i=1; {node} & b=$!; wait $a && wait $b"
    try:
        # seed 5 kills at step 11 of 16; seed 0 drew step 15, and a kill meant a few ms into the last step could
        # land after the run ended: no relaunch, "no relaunch happened" (timing, not a difference)
        verdict = assert_resumes_exactly(["sh", "-c", script], kills=1, seed=5, workdir=tmp_path / "prove", timeout=300)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert verdict.exact and sorted(verdict.launches) == [0, 1] and verdict.launches[0] == 2, verdict
    relaunch = (tmp_path / "prove" / "B" / "launch-2.log").read_text()
    assert "resuming from the memory tier" in relaunch, relaunch[-3000:]  # what the kill left in memory


def _replicated_under_slurm(machines: nodes.Cluster, cfg: dict[str, Any], where: list[int]) -> Callable[[], bool]:
    """Every rank's step-8 snapshot in its node's memory (``where[r]``) and a replica of it in some node's."""
    slot = lambda node, name: machines.slot(node, cfg["ckpt_dir"]) / f"{name}-of-{len(where)}.safetensors"
    own = [slot(where[r], f"rank-{r}") for r in range(len(where))]
    replicas = [[slot(n, f"replica-{r}") for n in range(2)] for r in range(len(where))]
    return lambda: (
        all(nodes.memory_step(f) == 8 for f in own)
        and all(any(nodes.memory_step(f) == 8 for f in copies) for copies in replicas)
    )


@pytest.mark.parametrize(
    ("devices", "distribution", "sharded"),
    [(1, "block", False), (2, "cyclic", False), (1, "block", True)],
    ids=["2x1", "2x2-cyclic", "2x1-sharded"],
)
def test_a_node_lost_under_slurm_resumes_from_the_peers_replica_exactly(
    tmp_path: Path, machines: nodes.Cluster, devices: int, distribution: str, sharded: bool
) -> None:
    """Launched as ``srun`` does (``tests/helpers/slurm_nodes.py``: one process per rank, SLURM's variables only):
    Lightning's ``SLURMEnvironment`` gives each rank its node, the ring replicates across nodes, node 1 is lost,
    and the relaunched job step resumes from node 0's replicas, bit for bit (A: the same job, uninterrupted).
    ``cyclic`` (``srun --distribution=cyclic``: rank r on node r % 2): the ring follows where ranks run, so no
    replica stays on its owner's node. ``sharded``: ``ShardedModelParallelStrategy`` (FSDP2, dp over every rank),
    each rank's snapshot its local shards."""
    world = 2 * devices
    where = [
        node for r in range(world) for node in range(2) if r in slurm_nodes.ranks_on(node, 2, devices, distribution)
    ]
    survivors = slurm_nodes.ranks_on(0, 2, devices, distribution)  # node 0's ranks, by local rank
    lost = slurm_nodes.ranks_on(1, 2, devices, distribution)
    cfg = _cfg(tmp_path, 2, devices)
    if sharded:
        cfg.update(sharded={"dp": world, "tp": 1}, safetensors=False, env={"PYTHONWARNINGS": "ignore"})
    a = dict(cfg, out=str(tmp_path / "A"), ckpt_dir=str(tmp_path / "A" / "ckpt"))
    slurm_nodes.run(a, machines, tmp_path, distribution)
    for rank in range(world):  # SLURM's placement, not torchrun's: the node from SLURM_NODEID
        cluster = _report(a, rank)["cluster"]
        assert cluster == {"environment": "SLURMEnvironment", "node_rank": where[rank], "num_nodes": 2,
                           "main_address": slurm_nodes.HOST}, cluster  # fmt: skip
    b = dict(cfg, out=str(tmp_path / "B"), pause_before=KILL_AT)
    running = slurm_nodes.run_until_paused(
        b, machines, tmp_path, _replicated_under_slurm(machines, b, where), distribution
    )
    running.lose(1)
    for r in lost:  # each lost rank's replica is on node 0, with the rank of its local rank there
        replica = machines.slot(0, b["ckpt_dir"]) / f"replica-{r}-of-{world}.safetensors"
        assert nodes.memory_step(replica) == 8, f"rank {r} (node 1) has no replica on node 0: {replica}"
    assert not list(machines.nodes[1].memory.iterdir()), "node 1 was replaced: its memory is empty"
    c = dict(cfg, out=str(tmp_path / "C"), resume="last")
    slurm_nodes.run(c, machines, tmp_path, distribution)
    sources = [r if r in survivors else survivors[lost.index(r)] for r in range(world)]
    out = nodes.output(c, tail=None)
    for rank in range(world):
        report = _report(c, rank)
        assert (report["tier"], report["memory_sources"]) == ("replica", sources), (report, out)
        assert report["cluster"]["environment"] == "SLURMEnvironment", report
    for r in lost:
        assert f"rank {r}'s state from rank {sources[r]}'s memory" in out, out
    assert not any(slurm_nodes.scontrol_calls(run) for run in (a, b, c))  # a SIGKILL is no preemption: no requeue
    _assert_exact(Path(a["out"]), c, 8, world)
