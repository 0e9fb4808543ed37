"""The replicated memory tier under ``ShardedModelParallelStrategy`` (FSDP2 ``fully_shard`` on gloo, dp over every
rank) across real "nodes" (``tests/helpers/nodes.py``: one ``torchrun --nnodes 2`` per node on 127.0.0.1, each
node its own memory). Each rank's memory snapshot is one file of its local shards (``sharded.local``), so the ring
moves it as it moves a DDP rank's. Run B is SIGKILLed between durable saves (disk: the sharded directory of step
6; memory: step 8, replicated to the next node), then node 1 is lost: its processes killed, its memory gone.

- Rank 1 gets its step-8 shards from node 0, which held their replica; the run goes on bit for bit against the
  uninterrupted run A (every step's loss bits, the gathered final state, ``prove``'s verdict); the resume report
  says tier "replica" and which rank's memory held each rank's state; no shard of the durable checkpoint is read
  (every file the relaunch opens under the durable directory is logged by an audit hook in the trainee).
- The same on 2 nodes x 2 ranks (dp=4), and with the durable directories on the S3 test server, where every object
  GET of the relaunch before its first step is counted: ``COMMITTED`` and ``meta.safetensors`` only.
- A replica damaged on node 0 is refused by its digest, named, and the run resumes from disk.

make test runs the 2x1 case (the path of every other case); make test-all all of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tests.helpers import kill_resume as h
from tests.helpers import nodes
from tests.helpers.s3 import s3_env

EXTENDED = frozenset(
    {
        "test_a_replica_damaged_on_the_peer_is_refused_and_the_sharded_run_resumes_from_disk",
        "test_a_node_lost_resumes_its_shards_from_the_peers_replica_exactly[2x2]",
        "test_a_node_lost_resumes_its_shards_from_the_peers_replica_with_durable_checkpoints_on_s3",
    }
)
"""In make test-all only: the fallback to disk of a damaged replica (the DDP module covers it in make test)."""

DURABLE_EVERY, MEMORY_EVERY, KILL_AT = 6, 2, 9
"""Durable snapshots every 6 steps, memory ones every 2: killed at step 9, disk has step 6, memory step 8."""

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]


def _cfg(tmp_path: Path, devices: int = 1) -> dict[str, Any]:
    memory = {"every_n_train_steps_max": MEMORY_EVERY}
    exact = {"schedule": {"every_n_train_steps_max": DURABLE_EVERY}, "memory_tier": memory}
    return {
        "n": 80, "batch_size": 4, "max_epochs": 2, "dropout": 0.2, "augment": True, "shuffle": True,
        "num_nodes": 2, "devices": devices, "sharded": {"dp": 2 * devices, "tp": 1}, "ckpt": {"save_top_k": 0},
        "exact_args": exact, "ckpt_dir": str(tmp_path / "ckpt"), "flush_memory_tier": True, "wait_replicated": True,
        "env": {"PYTHONWARNINGS": "ignore"},
    }  # fmt: skip


@pytest.fixture
def machines(tmp_path: Path) -> Iterator[nodes.Cluster]:
    with nodes.cluster(tmp_path / "machines", 2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Run A of 2 nodes x ``devices`` ranks: the whole fit, replicated, on its own machines, once per module; its
    output directory."""
    done: dict[int, Path] = {}

    def reference(devices: int = 1) -> Path:
        if devices not in done:
            root = tmp_path_factory.mktemp(f"A2x{devices}")
            with nodes.cluster(root / "machines", 2) as cluster:
                nodes.run(dict(_cfg(root, devices), out=str(root / "A")), cluster, root)
            done[devices] = root / "A"
        return done[devices]

    return reference


def _killed_then_node_lost(cfg: dict[str, Any], machines: nodes.Cluster, tmp_path: Path) -> None:
    b = dict(cfg, out=str(tmp_path / "B"), pause_before=KILL_AT)
    nodes.run_until_paused(b, machines, tmp_path, nodes.replicated_at(machines, b, 8)).lose(1)
    assert not list(machines.nodes[1].memory.iterdir()), "node 1 was replaced: its memory is empty"
    durable = sorted(p.name for p in Path(cfg["ckpt_dir"]).iterdir() if not p.name.startswith("."))
    assert durable == ["last-snapshot-step=000000006.ckpt"], f"one sharded directory, of step 6: {durable}"


def _resume(cfg: dict[str, Any], machines: nodes.Cluster, tmp_path: Path) -> dict[str, Any]:
    c = dict(cfg, out=str(tmp_path / "C"), resume="last", log_opened=cfg["ckpt_dir"])
    nodes.run(c, machines, tmp_path)
    return c


class ObjectGets:
    """The names of the objects the S3 server sent (GETs with a key) while ``counting()``."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.counting: Callable[[], bool] = lambda: False

    def wrap(self, app):
        def middleware(environ, start_response):
            _, _, key = environ.get("PATH_INFO", "").lstrip("/").partition("/")
            if environ.get("REQUEST_METHOD") == "GET" and key and self.counting():
                self.names.add(key.rsplit("/", 1)[-1])
            return app(environ, start_response)

        return middleware


@pytest.fixture
def object_gets(s3_server) -> Iterator[ObjectGets]:
    with s3_server.watched(ObjectGets()) as gets:
        yield gets


def _report(c: dict[str, Any], rank: int) -> dict[str, Any]:
    return json.loads((Path(c["out"]) / f"report-rank{rank}.json").read_text())


def _opened_before_training(c: dict[str, Any]) -> set[str]:
    """The names of the durable files any rank opened before its first training step (the trainee's log)."""
    names: set[str] = set()
    for path in Path(c["out"]).glob("opened-rank*.txt"):
        names |= {Path(line).name for line in path.read_text().splitlines() if line}
    return names


@pytest.mark.parametrize("devices", [1, 2], ids=["2x1", "2x2"])
def test_a_node_lost_resumes_its_shards_from_the_peers_replica_exactly(
    tmp_path: Path, machines: nodes.Cluster, uninterrupted, devices: int
) -> None:
    """2x2: dp=4, each of node 1's ranks from the same local rank of node 0 (the ring)."""
    a = uninterrupted(devices)
    cfg = _cfg(tmp_path, devices)
    _killed_then_node_lost(cfg, machines, tmp_path)
    c = _resume(cfg, machines, tmp_path)
    world = 2 * devices
    sources = list(range(devices)) * 2
    for rank in range(world):
        report = _report(c, rank)
        assert (report["tier"], report["step"], report["memory_sources"]) == ("replica", 8, sources), report
    out = nodes.output(c, tail=None)
    for rank in range(devices, world):
        assert f"rank {rank}'s state from rank {sources[rank]}'s memory" in out, out
    opened = _opened_before_training(c)
    assert opened == {"COMMITTED", "meta.safetensors"}, f"durable files read beyond the headers: {opened}"
    h.assert_exact_resume(a, Path(c["out"]), resumed_after=8, ranks=world)


def test_a_replica_damaged_on_the_peer_is_refused_and_the_sharded_run_resumes_from_disk(
    tmp_path: Path, machines: nodes.Cluster, uninterrupted
) -> None:
    a = uninterrupted()
    cfg = _cfg(tmp_path)
    _killed_then_node_lost(cfg, machines, tmp_path)
    replica = nodes.replica_file(machines, cfg["ckpt_dir"], 1, 2, 2)
    data = bytearray(replica.read_bytes())
    data[-5] ^= 0x01  # a tensor byte: only the digest can tell
    replica.write_bytes(bytes(data))
    c = _resume(cfg, machines, tmp_path)
    assert [_report(c, r)["tier"] for r in range(2)] == ["durable"] * 2
    out = nodes.output(c, tail=None)
    # named by its path, or by its kept save's (a hard link to the same damaged bytes, offered once the current
    # name was refused, and refused on arrival)
    named = str(replica) in out or str(replica.with_name(replica.stem)) + ".keep-" in out
    assert named and "checksum mismatch" in out, out
    h.assert_exact_resume(a, Path(c["out"]), resumed_after=DURABLE_EVERY, ranks=2)


def test_a_node_lost_resumes_its_shards_from_the_peers_replica_with_durable_checkpoints_on_s3(
    tmp_path: Path, machines: nodes.Cluster, uninterrupted, s3_bucket: str, s3_server, object_gets: ObjectGets
) -> None:
    """The durable directories on the S3 test server: the relaunch reads its ``COMMITTED`` marker and the header
    of its ``meta.safetensors``, no shard and no DCP metadata (every object GET counted until the first step)."""
    a = uninterrupted()
    cfg = dict(_cfg(tmp_path), ckpt_dir=f"{s3_bucket}/run", env={**_cfg(tmp_path)["env"], **s3_env(s3_server.endpoint)})
    b = dict(cfg, out=str(tmp_path / "B"), pause_before=KILL_AT)
    nodes.run_until_paused(b, machines, tmp_path, nodes.replicated_at(machines, b, 8)).lose(1)
    c = dict(cfg, out=str(tmp_path / "C"), resume="last")
    object_gets.counting = lambda: not (tmp_path / "C" / "steps-rank0.jsonl").exists()
    nodes.run(c, machines, tmp_path)
    for rank in range(2):
        report = _report(c, rank)
        assert (report["tier"], report["step"], report["memory_sources"]) == ("replica", 8, [0, 0]), report
    assert object_gets.names == {"COMMITTED", "meta.safetensors"}, object_gets.names
    h.assert_exact_resume(a, Path(c["out"]), resumed_after=8, ranks=2)
