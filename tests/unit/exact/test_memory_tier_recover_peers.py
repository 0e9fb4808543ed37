"""``MemoryTier.choose`` between two real processes ("two nodes", one rank each, gloo on 127.0.0.1), each with
its own memory dir holding its snapshot and the other's replica (a copy of the owner's file: that is what a
replica is). A lost node's rank gets its state from the peer's replica, streamed and verified, and the tier is
``replica``; a replica damaged on the peer, one that vanishes before it is sent, or one damaged on the way sends
every rank to the durable checkpoint with one line naming the rank, the file and the reason; so does losing
both nodes. The kill-and-resume runs of whole fits are in ``tests/integration/test_memory_tier_replicas.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.paths import free_port, job_script
from tests.helpers.processes import start_preloaded

SCENARIOS = (
    "own",
    "node1_lost",
    "node0_lost",
    "both_lost",
    "corrupt_replica",
    "replica_vanishes",
    "damaged_in_transit",
)


@pytest.fixture(scope="module")
def chosen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Every scenario, in one pair of processes: what each rank chose."""
    out = tmp_path_factory.mktemp("recover")
    port = free_port()
    ranks = [
        start_preloaded(job_script("recover_job.py"), [rank, port, out, *SCENARIOS], log=out / f"rank{rank}.log")
        for rank in (0, 1)
    ]
    for rank, proc in enumerate(ranks):
        assert proc.wait(300) == 0, (out / f"rank{rank}.log").read_text()[-4000:]
    return {name: [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in (0, 1)] for name in SCENARIOS}


def _durable_line(got: list[dict]) -> str:
    """Both ranks fell back to the durable checkpoint; the one line rank 0 logged about why."""
    assert [g["tier"] for g in got] == ["durable", "durable"] and all(g["durable"].endswith("step=6.ckpt") for g in got)
    assert [g["sources"] for g in got] == [None, None]
    (line,) = [line for line in got[0]["lines"] if "not resuming from the memory tier" in line]
    assert not [line for line in got[1]["lines"] if "memory tier" in line]  # rank 0 says it, once
    return line


@pytest.mark.multiprocess
def test_every_rank_with_its_own_snapshot_resumes_from_it(chosen) -> None:
    got = chosen["own"]
    assert [(g["tier"], g["sources"], g["step"], g["weights_equal"]) for g in got] == [("memory", [0, 1], 8, True)] * 2
    assert "resuming from the memory tier at step 8 (durable: step 6)" in got[0]["lines"][0]


@pytest.mark.multiprocess
def test_a_lost_nodes_rank_gets_its_state_from_the_peers_replica(chosen) -> None:
    for lost, sources in (("node1_lost", [0, 0]), ("node0_lost", [1, 1])):
        got = chosen[lost]
        assert [(g["tier"], g["sources"], g["step"], g["weights_equal"]) for g in got] == [
            ("replica", sources, 8, True)
        ] * 2
        receiver = 1 if lost == "node1_lost" else 0
        assert got[receiver]["file_is_the_replica"]  # installed as its own snapshot: the owner's bytes
        holder = 1 - receiver
        assert got[0]["lines"] == [
            f"ExactResume: resuming from the memory tier at step 8 (durable: step 6); rank {receiver}'s state from"
            f" rank {holder}'s memory"
        ]


@pytest.mark.multiprocess
def test_losing_both_nodes_resumes_from_disk_with_one_line(chosen) -> None:
    line = _durable_line(chosen["both_lost"])
    assert line.startswith("ExactResume: not resuming from the memory tier: no rank's memory holds a snapshot")


@pytest.mark.multiprocess
def test_a_replica_damaged_on_the_peer_is_refused_by_digest_naming_it(chosen) -> None:
    got = chosen["corrupt_replica"]
    line = _durable_line(got)
    assert "rank 1's state is missing: rank 1's replica on rank 0 (" in line
    assert "replica-1-of-2.safetensors) failed verification" in line and "checksum mismatch" in line
    assert any("skipping the memory-tier replica of rank 1" in w for w in got[0]["warned"])


@pytest.mark.multiprocess
def test_a_replica_gone_before_it_is_sent_sends_every_rank_to_disk(chosen) -> None:
    line = _durable_line(chosen["replica_vanishes"])
    assert "rank 1's replica on rank 0 (" in line and "replica-1-of-2.safetensors) is gone" in line
    assert "was not sent" in line  # what rank 1 saw: the holder's "nothing"


@pytest.mark.multiprocess
def test_a_replica_damaged_on_the_way_fails_the_owners_check(chosen) -> None:
    """Refused as it arrives (``write_received(verify=True)``), before the rename: not installed, then loaded."""
    line = _durable_line(chosen["damaged_in_transit"])
    assert "rank 1's replica on rank 0 (" in line and "failed verification on arrival in" in line
    assert "checksum mismatch" in line


def test_a_holder_checks_a_replica_without_keeping_its_tensors(tmp_path: Path) -> None:
    """What a rank offers of a replica is verified a chunk at a time: the tensors are 1-element stand-ins (a
    holder of a large state does not load it to offer it), a damaged one is refused naming the file, and so is
    the replica of another rank under this owner's name."""
    import torch

    from lightning_resume.errors import CheckpointCorruptError
    from lightning_resume.memory.store import MemoryStore, memory_root, replica_name

    root, key = memory_root(str(tmp_path)), "0123456789abcdef"
    owner = MemoryStore(root + "-owner", key, rank=1, world_size=2, asynchronous=False)
    owner.save({"global_step": 8, "w": torch.arange(1 << 16, dtype=torch.float32)}, step=8, seq=4, run="r")
    holder = MemoryStore(root, key, rank=0, world_size=2, asynchronous=False)
    data = Path(owner.path).read_bytes()
    holder.write_received(replica_name(1, 2), len(data), [memoryview(data)])
    checked = holder.check_replica(1, "r")
    assert checked is not None and (checked.step, checked.seq, checked.path) == (8, 4, holder.replica_path(1))
    w = checked.checkpoint["w"]
    assert w.shape == (1 << 16,) and w.untyped_storage().nbytes() == 4  # a stand-in, not the 256 KiB
    holder.write_received(replica_name(0, 2), len(data), [memoryview(data)])  # rank 1's bytes as rank 0's replica
    with pytest.raises(CheckpointCorruptError, match="not rank 0's"):
        holder.check_replica(0, "r")
    damaged = bytearray(data)
    damaged[-3] ^= 0xFF
    holder.write_received(replica_name(1, 2), len(damaged), [memoryview(bytes(damaged))])
    with pytest.raises(CheckpointCorruptError, match=r"replica-1-of-2\.safetensors.*checksum mismatch"):
        holder.check_replica(1, "r")
