"""Where a rank's memory-tier replicas live: nodes, the ring over them, and the resolved replica count.

A node is ``trainer.node_rank`` of ``trainer.num_nodes``, with ``p = world_size // num_nodes`` ranks each;
rank ``r = node * p + local_rank`` (torchrun's layout, and SLURM's default block distribution). Where the
launcher numbered ranks otherwise (``srun --distribution=cyclic``: rank r on node r % num_nodes),
:func:`placed` maps every rank to its place in that layout from the node each rank reports. Replica ``j`` (1..k) of a
rank lives on the rank of the same local rank ``j`` nodes further round the ring, so no node holds a
replica of its own ranks and losing one node loses no rank's every copy while ``k >= 1``. Pure: plain
integers in, plain integers out; no torch, no Lightning, no files.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from lightning_resume.errors import ConfigurationError

OPTION = "memory_tier.replicas"
"""The option the replica count comes from, as messages name it."""


def resolve_replicas(option: Optional[int], num_nodes: int) -> int:
    """The replica count of a run on ``num_nodes`` nodes: ``option``, or when it is ``None`` one replica on more
    than one node and none on one. ``ConfigurationError`` naming :data:`OPTION` when ``option >= num_nodes``:
    some node would have to hold a replica of its own ranks, which its loss would take with it."""
    if option is None:
        return 1 if num_nodes > 1 else 0
    if option >= num_nodes:
        raise ConfigurationError("ExactResume", [
            f"{OPTION}={option} needs at least {option + 1} nodes (each replica on another node than its owner),"
            f" but the run has num_nodes={num_nodes}; use {OPTION}={max(num_nodes - 1, 0)} or fewer, or leave"
            f" it unset (1 on more than one node, 0 on one)"
        ])  # fmt: skip
    return int(option)


def ranks_per_node(world_size: int, num_nodes: int) -> int:
    """``p``: ranks per node. ``ValueError`` when the world does not split evenly (no such Lightning layout)."""
    if num_nodes < 1 or world_size < num_nodes or world_size % num_nodes:
        raise ValueError(f"world_size={world_size} is not a whole number of ranks on each of {num_nodes} nodes")
    return world_size // num_nodes


def placed(node_ranks: Sequence[int], num_nodes: int) -> List[int]:
    """``node_ranks[r]`` (the node rank ``r`` runs on, as its launcher says) to the rank order of the node-by-node
    layout: ``order[i]`` is the rank at place ``i = node * p + i-th rank of the node``. The identity for torchrun
    and SLURM's block distribution. ``ValueError`` when the nodes do not have ``p`` ranks each."""
    p = ranks_per_node(len(node_ranks), num_nodes)
    order = [r for node in range(num_nodes) for r, n in enumerate(node_ranks) if n == node]
    counts = [list(node_ranks).count(node) for node in range(num_nodes)]
    if len(order) != len(node_ranks) or set(counts) != {p}:
        raise ValueError(f"ranks' nodes {list(node_ranks)} are not {p} ranks on each of {num_nodes} nodes")
    return order


def replica_holders(rank: int, world_size: int, num_nodes: int, k: int) -> List[int]:
    """The ranks that hold ``rank``'s replicas, replica 1 first: the same local rank on the next ``k`` nodes."""
    p = ranks_per_node(world_size, num_nodes)
    _check(rank, world_size, num_nodes, k)
    node, local = divmod(rank, p)
    return [((node + j) % num_nodes) * p + local for j in range(1, k + 1)]


def replicas_held(rank: int, world_size: int, num_nodes: int, k: int) -> List[int]:
    """The ranks whose replicas ``rank`` holds, nearest first: the same local rank on the previous ``k`` nodes."""
    p = ranks_per_node(world_size, num_nodes)
    _check(rank, world_size, num_nodes, k)
    node, local = divmod(rank, p)
    return [((node - j) % num_nodes) * p + local for j in range(1, k + 1)]


def _check(rank: int, world_size: int, num_nodes: int, k: int) -> None:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    if not 0 <= k < num_nodes:
        raise ValueError(f"{k} replicas need more than {num_nodes} nodes (resolve_replicas refuses this)")
