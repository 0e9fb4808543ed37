"""The replica ring: which ranks hold a rank's replicas, which replicas a rank holds, and the resolved count."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_resume.errors import ConfigurationError
from lightning_resume.memory.topology import placed, replica_holders, replicas_held, resolve_replicas
from tests.helpers.memory_oracles import node_of


def test_two_nodes_of_two_ranks_hold_each_others_same_local_rank() -> None:
    assert [replica_holders(r, 4, 2, 1) for r in range(4)] == [[2], [3], [0], [1]]
    assert [replicas_held(r, 4, 2, 1) for r in range(4)] == [[2], [3], [0], [1]]


def test_three_nodes_two_replicas_go_round_the_ring() -> None:
    assert replica_holders(0, 3, 3, 2) == [1, 2] and replicas_held(0, 3, 3, 2) == [2, 1]
    assert replica_holders(5, 6, 3, 2) == [1, 3]  # node 2, local rank 1: nodes 0 and 1


def test_the_default_is_one_replica_on_several_nodes_and_none_on_one() -> None:
    assert resolve_replicas(None, 1) == 0 and resolve_replicas(None, 2) == 1 and resolve_replicas(None, 8) == 1
    assert resolve_replicas(0, 4) == 0 and resolve_replicas(2, 3) == 2


@pytest.mark.parametrize(("option", "nodes"), [(1, 1), (2, 2), (5, 3)])
def test_a_replica_that_would_stay_on_its_own_node_is_refused_naming_the_option(option: int, nodes: int) -> None:
    with pytest.raises(ConfigurationError, match=rf"memory_tier.replicas={option} .*num_nodes={nodes}"):
        resolve_replicas(option, nodes)


def test_a_world_that_does_not_split_into_nodes_is_refused() -> None:
    with pytest.raises(ValueError, match="not a whole number"):
        replica_holders(0, 3, 2, 1)


@given(st.integers(2, 6), st.integers(1, 4), st.data())
def test_no_rank_holds_its_own_nodes_replica_and_holding_is_the_inverse_of_sending(
    nodes: int, per_node: int, data: st.DataObject
) -> None:
    world = nodes * per_node
    k = data.draw(st.integers(0, nodes - 1))
    for rank in range(world):
        holders = replica_holders(rank, world, nodes, k)
        assert len(set(node_of(h, world, nodes) for h in holders)) == k  # k distinct nodes
        assert node_of(rank, world, nodes) not in {node_of(h, world, nodes) for h in holders}
        assert all(h % per_node == rank % per_node for h in holders)  # same local rank
        for holder in holders:
            assert rank in replicas_held(holder, world, nodes, k)
        assert sorted(replicas_held(rank, world, nodes, k)) == sorted(
            o for o in range(world) if rank in replica_holders(o, world, nodes, k)
        )


def test_ranks_placed_node_by_node_keep_their_order() -> None:
    assert placed([0, 0, 1, 1], 2) == [0, 1, 2, 3]  # torchrun, SLURM's block distribution


def test_a_cyclic_layout_puts_each_replica_on_another_node() -> None:
    """``srun --distribution=cyclic``: rank r on node r % 2. Node by node, rank 1 (node 1) would send its replica to
    rank 3, on node 1 too: the node's loss would take both copies."""
    order = placed([0, 1, 0, 1], 2)
    assert order == [0, 2, 1, 3]
    holders = {r: [order[h] for h in replica_holders(order.index(r), 4, 2, 1)] for r in range(4)}
    assert holders == {0: [1], 1: [0], 2: [3], 3: [2]}


@given(st.integers(2, 5), st.integers(1, 3), st.randoms(use_true_random=False))
def test_wherever_the_launcher_puts_ranks_no_replica_stays_on_its_node(nodes: int, per_node: int, rnd) -> None:
    where = [r // per_node for r in range(nodes * per_node)]
    rnd.shuffle(where)
    order = placed(where, nodes)
    for rank in range(nodes * per_node):
        holders = [order[h] for h in replica_holders(order.index(rank), nodes * per_node, nodes, nodes - 1)]
        assert sorted(where[h] for h in holders) == sorted(set(range(nodes)) - {where[rank]})


def test_nodes_of_unequal_size_are_refused() -> None:
    with pytest.raises(ValueError, match="not 2 ranks on each of 2 nodes"):
        placed([0, 0, 0, 1], 2)
