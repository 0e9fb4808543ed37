"""The gate of replicated memory snapshots (``memory.anchor``, ``memory.replicate.agree``): a save is replicated only
when no rank's replicator is busy, so every rank replicates the same saves; the anchor is the oldest save every
rank's holders acknowledged, and the saves kept below it go; without room to keep, nothing is kept, said once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_resume.memory.anchor import Gate, Vote, decide
from tests.helpers.paths import free_port, job_script
from tests.helpers.processes import start_preloaded


def vote(
    busy: bool = False,
    acked: tuple[int, ...] = (4,),
    replicating: bool = True,
    pinned: int = 10,
    free: int = 100,
    node: int = -1,
) -> Vote:
    return Vote(replicating, busy, frozenset(acked), pinned, free, node)


@pytest.mark.parametrize(
    ("votes", "gate"),
    [
        ([vote(), vote()], Gate(True, 4)),
        ([vote(acked=(3, 4, 5)), vote(busy=True, acked=(3,))], Gate(False, 3)),  # one busy rank: nobody replicates
        ([vote(acked=()), vote(acked=())], Gate(True, -1)),  # nothing acknowledged yet: nothing kept goes
        ([vote(acked=(5,)), vote(replicating=False, busy=True, acked=())], Gate(True, 5)),  # stopped there: no vote
        ([vote(replicating=False), vote(replicating=False)], Gate(False, None)),
        ([vote(), vote(pinned=200, free=100)], Gate(True, None, (1, 200, 100))),  # no room to keep: no anchor
        # two ranks of node 1 share its tmpfs: each fits alone, both together do not
        ([vote(node=0), vote(pinned=60, node=1), vote(pinned=60, node=1)], Gate(True, None, (1, 120, 100))),
        ([vote(node=0), vote(pinned=60, node=1), vote(pinned=60, node=2)], Gate(True, 4)),  # one per node: room
        # rank 0 lost save 5 (a holder's write failed) but its 6 is acknowledged, rank 1 is at 5: the anchor is 3,
        # the newest save both kept, not min(6, 5) = 5, which rank 0's holders never stored
        ([vote(acked=(3, 6)), vote(acked=(3, 4, 5))], Gate(True, 3)),
    ],
    ids=[
        "idle",
        "one-busy",
        "none-acked",
        "one-stopped",
        "none-replicate",
        "no-room",
        "node-short",
        "node-room",
        "gap",
    ],
)
def test_the_gate(votes: list[Vote], gate: Gate) -> None:
    assert decide(votes) == gate


@given(st.lists(st.tuples(st.booleans(), st.frozensets(st.integers(0, 12))), min_size=1, max_size=6))
def test_the_anchor_is_the_newest_save_every_rank_kept(ranks: list[tuple[bool, frozenset]]) -> None:
    gate = decide([vote(busy=busy, acked=tuple(acked)) for busy, acked in ranks])
    assert gate.replicate == (not any(busy for busy, _ in ranks))
    common = frozenset.intersection(*(acked for _, acked in ranks))
    assert gate.anchor == max(common, default=-1)  # a complete set, or -1: nothing kept goes
    assert all(gate.anchor == -1 or gate.anchor in acked for _, acked in ranks)


@pytest.mark.multiprocess
def test_a_busy_rank_stops_every_rank_replicating_and_the_anchor_is_the_oldest_acknowledged(tmp_path: Path) -> None:
    port = free_port()
    ranks = [
        start_preloaded(job_script("gate_job.py"), [r, port, tmp_path], log=tmp_path / f"log{r}.txt") for r in (0, 1)
    ]
    for rank, proc in enumerate(ranks):
        assert proc.wait(180) == 0, (tmp_path / f"log{rank}.txt").read_text()[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["ended"] for r in reports)
    for rank, report in enumerate(reports):
        other = 1 - rank
        own = lambda *seqs: [f"rank-{rank}-of-2.keep-{s}.safetensors" for s in seqs]
        held = lambda *seqs: [f"replica-{other}-of-2.keep-{s}.safetensors" for s in seqs]
        got = [(s["replicated"], s["anchor"], s["kept"]) for s in report["saves"]]
        assert got == [
            (True, -1, own(1) + held(1)),
            (True, 1, own(1, 2) + held(1, 2) if rank == 1 else own(1, 2) + held(1)),  # rank 1's save 2 is held
            (False, 1, own(1, 2) + held(1, 2)),  # rank 1 was still sending save 2: save 3 is nobody's to replicate
            (True, 2, own(2, 4) + held(2, 4)),  # a complete set of save 2 exists: save 1's keeps go
            (True, None, []),  # rank 1's memory cannot hold more: nothing is kept
        ], (rank, got)
    assert [w for w in reports[1]["warnings"] if "kept" in w] == []
    (warning,) = [w for w in reports[0]["warnings"] if "no save is kept" in w]
    assert "rank 1's node has 1.0 KiB (1024 bytes) free, less than the 1.0 MiB" in warning and "/dev/shm" in warning
