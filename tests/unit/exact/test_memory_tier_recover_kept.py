"""Recovery with kept saves: a node lost while its newest replica was in transit resumes from the newest complete
set, the anchor (``memory.recover`` with ``RankOffer.kept``; ``memory.peers`` makes a kept own save current again).
The policy for any history, then ``MemoryTier.choose`` between two real processes (``keep_recover_job.py``)."""

from __future__ import annotations

import json
from typing import Optional

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_resume.memory.recover import Held, RankOffer, RecoveryPlan, plan_recovery
from tests.helpers.paths import free_port, job_script
from tests.helpers.processes import start_preloaded

W = 2


def held(owner: int, seq: int, kept: bool = False, replica: bool = False) -> Held:
    stem = f"{'replica' if replica else 'rank'}-{owner}-of-{W}"
    name = f"{stem}.keep-{seq}.safetensors" if kept else f"{stem}.safetensors"
    return Held(owner, 2 * seq, seq, float(seq), f"/shm/{name}", name, kept)


def offer(rank: int, own: Optional[Held], replicas: tuple = (), kept: tuple = ()) -> RankOffer:
    return RankOffer(rank, own, tuple(replicas), (), 6, tuple(kept))


def test_node_lost_while_its_newest_replica_is_in_transit_resumes_at_the_anchor() -> None:
    """Rank 0: own save 5, kept 4, rank 1's replica at 4 (its 5 was in transit); node 1 is lost."""
    offers = [offer(0, held(0, 5), [held(1, 4, replica=True)], [held(0, 4, kept=True)]), offer(1, None)]
    got = plan_recovery(offers, W, 6)
    assert isinstance(got, RecoveryPlan)
    assert (got.step, got.seq, got.sources, got.kept, got.own_kept) == (8, 4, (0, 0), (0,), True)
    assert got.names == ("rank-0-of-2.keep-4.safetensors", "replica-1-of-2.safetensors")
    assert got.transfers == ((0, 1),)


def test_a_kept_replica_is_sent_when_the_current_one_is_newer() -> None:
    """Rank 1 lost; rank 0 holds rank 1's replica at 5 (arrived) but its own 5 never committed: both at 4."""
    offers = [
        offer(0, held(0, 4), [held(1, 5, replica=True)], [held(1, 4, kept=True, replica=True)]),
        offer(1, None),
    ]
    got = plan_recovery(offers, W, 6)
    assert isinstance(got, RecoveryPlan) and got.seq == 4 and got.kept == (1,) and not got.own_kept
    assert got.names == ("rank-0-of-2.safetensors", "replica-1-of-2.keep-4.safetensors")


def test_without_kept_saves_the_same_loss_falls_back_to_disk() -> None:
    offers = [offer(0, held(0, 5), [held(1, 4, replica=True)]), offer(1, None)]
    got = plan_recovery(offers, W, 6)
    assert not isinstance(got, RecoveryPlan)
    assert "rank 1's state is missing: only step 8 (save 4) on rank(s) [0]" in got.reason


def test_a_current_file_is_chosen_before_a_kept_one_of_the_same_save() -> None:
    offers = [offer(0, held(0, 4), [held(1, 4, replica=True)], [held(0, 4, kept=True)]), offer(1, held(1, 4))]
    got = plan_recovery(offers, W, 6)
    assert isinstance(got, RecoveryPlan) and got.kept == () and got.sources == (0, 1)


@st.composite
def histories(draw: st.DrawFn) -> tuple[int, int, list[int], list[int]]:
    """N nodes of one rank, replicas on the next node round the ring, every save replicated (the gate) up to n.
    G, the anchor: every rank's holder stored it. Rank r committed own[r] >= G (a kill may have come before n), its
    holder holds its replica of arrived[r], G <= arrived[r] <= own[r]; every save from G up is kept on both sides."""
    n_nodes = draw(st.integers(2, 5))
    newest = draw(st.integers(1, 12))
    anchor = draw(st.integers(1, newest))
    own = [draw(st.integers(anchor, newest)) for _ in range(n_nodes)]
    arrived = [draw(st.integers(anchor, own[r])) for r in range(n_nodes)]
    return n_nodes, anchor, own, arrived


def _offers(n_nodes: int, own: list[int], arrived: list[int], anchor: int, lost: int) -> list[RankOffer]:
    offers = []
    for rank in range(n_nodes):
        if rank == lost:
            offers.append(RankOffer(rank, None))
            continue
        owner = (rank - 1) % n_nodes  # whose replicas this rank holds
        mine = [held(rank, s, kept=True) for s in range(anchor, own[rank])]
        theirs = [held(owner, s, kept=True, replica=True) for s in range(anchor, arrived[owner])]
        offers.append(offer(rank, held(rank, own[rank]), [held(owner, arrived[owner], replica=True)], mine + theirs))
    return offers


@given(histories(), st.data())
def test_any_history_minus_any_one_node_resumes_at_the_anchor_or_newer(history, data) -> None:
    n_nodes, anchor, own, arrived = history
    lost = data.draw(st.integers(0, n_nodes - 1))
    got = plan_recovery(_offers(n_nodes, own, arrived, anchor, lost), n_nodes, -1)
    assert isinstance(got, RecoveryPlan), got
    assert got.seq >= anchor
    for rank, source in enumerate(got.sources):
        assert source != lost and (source == rank or source == (rank + 1) % n_nodes)
        assert got.names[rank].startswith("rank" if source == rank else "replica")
        assert (rank in got.kept) == (".keep-" in got.names[rank])


@pytest.fixture(scope="module")
def chosen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("keep")
    port = free_port()
    names = ["node1_lost_in_transit", "rank1_behind"]
    ranks = [
        start_preloaded(job_script("keep_recover_job.py"), [r, port, out, *names], log=out / f"rank{r}.log")
        for r in (0, 1)
    ]
    for rank, proc in enumerate(ranks):
        assert proc.wait(300) == 0, (out / f"rank{rank}.log").read_text()[-4000:]
    return {name: [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in (0, 1)] for name in names}


@pytest.mark.multiprocess
def test_a_node_lost_mid_transfer_resumes_from_the_kept_set(chosen) -> None:
    """Rank 0 makes its kept save 4 current again; rank 1 gets its save 4 from rank 0's replica."""
    got = chosen["node1_lost_in_transit"]
    assert [(g["tier"], g["sources"], g["step"], g["weights_equal"]) for g in got] == [("replica", [0, 0], 8, True)] * 2
    assert got[0]["lines"] == [
        "ExactResume: resuming from the memory tier at step 8 (durable: step 6); rank 1's state from rank 0's memory"
    ]
    assert got[0]["slot"] == ["rank-0-of-2.safetensors", "replica-1-of-2.safetensors"]  # the keeps are gone
    assert got[1]["slot"] == ["rank-1-of-2.safetensors"]


@pytest.mark.multiprocess
def test_a_rank_behind_its_peers_resumes_every_rank_from_the_kept_save(chosen) -> None:
    """No node lost: rank 1 was killed before its save 5 committed; rank 0 resumes from its own kept save 4, and
    rank 0's save 5 held by rank 1 (a line of training the run leaves) is dropped."""
    got = chosen["rank1_behind"]
    assert [(g["tier"], g["sources"], g["step"], g["weights_equal"]) for g in got] == [("memory", [0, 1], 8, True)] * 2
    assert got[0]["slot"] == ["rank-0-of-2.safetensors", "replica-1-of-2.safetensors"]
    assert got[1]["slot"] == ["rank-1-of-2.safetensors"]  # rank 0's save 5 went with the keeps
