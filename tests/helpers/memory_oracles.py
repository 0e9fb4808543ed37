"""Test-only views of the memory tier that the product does not need: a replica read back whole, and the node a
rank runs on in the node-by-node layout. The product checks a held replica without keeping its tensors
(``MemoryStore.check_replica``) and gathers where each rank runs (``memory.topology.placed``)."""

from __future__ import annotations

from typing import Optional

from lightning_resume.memory.store import MemorySnapshot, MemoryStore, replica_name
from lightning_resume.memory.topology import ranks_per_node


def load_replica(store: MemoryStore, owner: int, run: str) -> Optional[MemorySnapshot]:
    """Rank ``owner``'s replica in ``store``'s slot with its tensors, verified as ``MemoryStore.load`` verifies a
    snapshot (every checksum; the record says rank ``owner``, the store's world size, slot and run ``run``);
    ``None`` when there is none. ``CheckpointCorruptError`` naming the file when it does not verify."""
    what = f"not rank {owner}'s memory-tier snapshot of this slot and run"
    return store._load(replica_name(owner, store.world_size), owner, run, what)


def node_of(rank: int, world_size: int, num_nodes: int) -> int:
    """The node that ``rank`` runs on in the node-by-node layout (torchrun, SLURM's block distribution)."""
    return rank // ranks_per_node(world_size, num_nodes)
