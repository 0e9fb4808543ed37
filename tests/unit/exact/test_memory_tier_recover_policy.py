"""The recovery policy of the replicated memory tier (``memory.recover.plan_recovery``): which save every rank
resumes from after a relaunch and from whose memory, or why none, for the states a cluster is left in."""

from __future__ import annotations

from typing import Optional

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_resume.memory.recover import Held, NoRecovery, RankOffer, RecoveryPlan, Refused, plan_recovery


def own(rank: int, step: int = 8, seq: int = 4, saved_at: Optional[float] = None) -> Held:
    return Held(rank, step, seq, float(rank) if saved_at is None else saved_at, f"/shm/rank-{rank}")


def replica(owner: int, step: int = 8, seq: int = 4) -> Held:
    return Held(owner, step, seq, float(owner), f"/shm/replica-{owner}")


def offer(rank: int, mine: Optional[Held], *replicas: Held, refused: tuple = (), durable: int = 6) -> RankOffer:
    return RankOffer(rank, mine, tuple(replicas), tuple(refused), durable)


def plan(offers: list[RankOffer], durable: int = 6) -> RecoveryPlan:
    outcome = plan_recovery(offers, len(offers), durable)
    assert isinstance(outcome, RecoveryPlan), outcome
    return outcome


def none(offers: list[RankOffer], durable: int = 6) -> str:
    outcome = plan_recovery(offers, len(offers), durable)
    assert isinstance(outcome, NoRecovery), outcome
    return outcome.reason


def test_every_rank_has_its_own_snapshot_each_resumes_from_its_own() -> None:
    """The replicas held are not used when the owners have the same save: no transfer at all."""
    got = plan([offer(0, own(0), replica(1)), offer(1, own(1), replica(0))])
    assert (got.step, got.seq, got.sources, got.transfers, got.from_peers) == (8, 4, (0, 1), (), False)
    assert got.saved_at == 0.0 and got.paths == ("/shm/rank-0", "/shm/rank-1")


def test_a_lost_node_gets_its_state_from_the_rank_holding_its_replica() -> None:
    """2 nodes x 1 rank: node 1 replaced (empty memory); rank 0 holds rank 1's replica of the same save."""
    got = plan([offer(0, own(0), replica(1)), offer(1, None)])
    assert got.sources == (0, 0) and got.transfers == ((0, 1),) and got.from_peers
    assert got.paths == ("/shm/rank-0", "/shm/replica-1")


def test_a_lost_rank_zero_takes_rank_zeros_save_time_from_its_replica() -> None:
    got = plan([offer(0, None), offer(1, own(1), replica(0))])
    assert got.sources == (1, 1) and got.saved_at == 0.0  # the replica holds rank 0's own record


def test_two_nodes_of_two_ranks_lose_node_one() -> None:
    """Ring k=1 over nodes of 2 ranks: rank 0 holds rank 2's replica, rank 1 rank 3's, and the other way round."""
    offers = [offer(0, own(0), replica(2)), offer(1, own(1), replica(3)), offer(2, None), offer(3, None)]
    assert plan(offers).transfers == ((0, 2), (1, 3))


def test_the_lowest_holding_rank_sends_when_several_hold_the_replica() -> None:
    """k=2 over three nodes: both survivors hold rank 0's replica; rank 1 (the lowest) sends it."""
    offers = [offer(0, None), offer(1, own(1), replica(0), replica(2)), offer(2, own(2), replica(0), replica(1))]
    assert plan(offers).sources == (1, 1, 2)


def test_losing_a_node_and_its_replica_holder_names_the_missing_state() -> None:
    """Three nodes, k=1: node 1's replica lives on node 2; both are lost. Rank 0 alone cannot rebuild the run."""
    reason = none([offer(0, own(0), replica(2)), offer(1, None), offer(2, None)])
    assert reason == (
        "no rank holds every rank's state of step 8 (save 4): no verified snapshot on rank(s) [1] and no replica"
        " of rank 1's state on any rank"
    )


def test_losing_every_node_says_so() -> None:
    assert none([offer(0, None), offer(1, None)]) == "no rank's memory holds a snapshot of this run"


def test_ranks_at_different_saves_are_named_with_what_they_have() -> None:
    """Rank 1's newest own snapshot is one save behind (its write of save 4 did not commit before the kill)."""
    reason = none([offer(0, own(0)), offer(1, own(1, step=6, seq=3))], durable=4)
    assert "step 8 (save 4)" in reason and "rank 1's state is missing: only step 6 (save 3) on rank(s) [1]" in reason


def test_an_older_save_every_rank_has_beats_a_newer_one_some_rank_lacks() -> None:
    """A replica lagging one save (coalesced while in flight) still rebuilds the run when the owners' other
    copies are of that save too: rank 1's replica on rank 0 is of save 3, and rank 0's state of save 3 is on rank 1."""
    offers = [offer(0, own(0), replica(1, 6, 3)), offer(1, None, replica(0, 6, 3))]
    got = plan(offers, durable=4)
    assert (got.step, got.seq, got.sources) == (6, 3, (1, 0))


def test_a_replica_older_than_the_durable_checkpoint_is_not_used() -> None:
    reason = none([offer(0, own(0, 6, 3), replica(1, 6, 3)), offer(1, None)], durable=6)
    assert reason == "its newest step 6 is not newer than the durable checkpoint's step 6"
    assert none([offer(0, own(0, 8, 4), replica(1, 4, 2)), offer(1, None)], durable=6).startswith(
        "no rank holds every rank's state of step 8 (save 4): rank 1's state is missing: only step 4 (save 2)"
    )


def test_a_corrupt_replica_is_not_offered_and_the_refusal_is_named() -> None:
    bad = Refused(1, "/shm/replica-1", "checksum mismatch in tensor 'w'")
    reason = none([offer(0, own(0), refused=(bad,)), offer(1, None)])
    assert reason == (
        "no rank holds every rank's state of step 8 (save 4): rank 1's state is missing: rank 1's replica on rank 0"
        " (/shm/replica-1) failed verification: checksum mismatch in tensor 'w'"
    )


def test_a_corrupt_replica_with_a_good_one_elsewhere_still_recovers() -> None:
    bad = Refused(0, "/shm/replica-0", "checksum mismatch")
    offers = [offer(0, None), offer(1, own(1), replica(2), refused=(bad,)), offer(2, own(2), replica(0), replica(1))]
    assert plan(offers).sources == (2, 1, 2)


def test_a_refused_own_snapshot_alone_is_named() -> None:
    bad = Refused(0, "/shm/rank-0", "checksum mismatch")
    assert (
        none([offer(0, None, refused=(bad,))])
        == "rank 0's snapshot on rank 0 (/shm/rank-0) failed verification: checksum mismatch"
    )


def test_one_rank_without_peers_resumes_from_its_own_snapshot() -> None:
    assert plan([offer(0, own(0))]).sources == (0,)
    assert "no verified snapshot on rank(s) [1]" in none([offer(0, own(0)), offer(1, None)])


def test_malformed_offers_are_a_callers_bug() -> None:
    with pytest.raises(ValueError, match="one offer per rank"):
        plan_recovery([offer(1, None)], 1, 6)
    with pytest.raises(ValueError, match="as its own"):
        plan_recovery([offer(0, own(1))], 1, 6)
    with pytest.raises(ValueError, match="a replica of rank 0"):
        plan_recovery([offer(0, None, replica(0))], 1, 6)
    with pytest.raises(ValueError, match="a replica of rank 5"):
        plan_recovery([offer(0, None, replica(5)), offer(1, None)], 2, 6)


_saves = st.sampled_from([(4, 2), (6, 3), (8, 4), (10, 5)])


@st.composite
def _cluster(draw: st.DrawFn) -> tuple[list[RankOffer], int]:
    world = draw(st.integers(1, 5))
    durable = draw(st.sampled_from([-1, 4, 6, 8]))
    offers = []
    for rank in range(world):
        mine = draw(st.none() | _saves.map(lambda s, r=rank: own(r, *s)))
        others = [o for o in range(world) if o != rank]
        held = draw(st.lists(st.sampled_from(others), unique=True)) if others else []
        offers.append(offer(rank, mine, *[replica(o, *draw(_saves)) for o in held], durable=durable))
    return offers, durable


@given(_cluster())
def test_a_plan_is_complete_newest_and_prefers_each_rank_own(cluster: tuple[list[RankOffer], int]) -> None:
    """For any cluster: a plan gives every rank a source really holding that save, newer than durable, the owner
    whenever it holds it, else the lowest holder; no newer save is complete; none exactly when no save is."""
    offers, durable = cluster
    holders: list[dict[tuple[int, int], list[int]]] = [{} for _ in offers]
    for o in offers:
        for h in ([o.own] if o.own else []) + list(o.replicas):
            holders[h.owner].setdefault(h.save, []).append(o.rank)
    complete = [s for s in {s for h in holders for s in h} if s[0] > durable and all(s in h for h in holders)]
    outcome = plan_recovery(offers, len(offers), durable)
    if not complete:
        assert isinstance(outcome, NoRecovery)
        return
    assert isinstance(outcome, RecoveryPlan) and (outcome.step, outcome.seq) == max(complete)
    for owner, source in enumerate(outcome.sources):
        ranks = holders[owner][max(complete)]
        assert source == (owner if owner in ranks else min(ranks))
