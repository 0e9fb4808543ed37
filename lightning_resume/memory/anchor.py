"""Which memory snapshots are replicated, and which replicated save is the anchor: a pure policy over the ranks' votes.

At each memory save that the schedule replicates, every rank says (:class:`Vote`) whether its replicator is still busy
with an earlier save, the saves of its own that every one of its holders stored and kept (acknowledged) since the
anchor, and how much memory its kept saves could pin against what is free. :func:`decide` answers for every rank alike (:class:`Gate`):

- the save is replicated only when no replicating rank is busy, so every rank replicates the same saves, each one
  whole (a busy rank would otherwise skip a save the others sent, and no complete set of that save would exist);
- the anchor is the newest save every rank acknowledged: every rank's state of it is kept in the memory of every one
  of its holders, so a node lost while a newer save is in transit still finds a complete set at the anchor. Saves
  kept below it (``memory.store``, ``keep-<seq>``) can go. Not the oldest of each rank's newest: a rank that lost
  one save (a holder's write failed, its own save failed after the gate) while later ones were acknowledged would
  make that a save some holder never stored, and the prune would remove the older complete set. The previous
  anchor stays in every rank's set until a newer common one replaces it, so the anchor never goes back; ``-1``
  (nothing goes) until a first save is common;
- no anchor when some node's memory cannot hold one more copy of what its ranks keep (the ranks of a node share its
  tmpfs, so their keeps add up against the one free space): kept saves would make a later snapshot or replica not
  fit, so none are kept (as before there were any), said once by the caller with the sizes.

Plain records in, a decision out: no collectives, no files (``memory.replicate.agree`` does those).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class Vote:
    """One rank's word at a replicated save."""

    replicating: bool
    """Whether this rank replicates at all (replication may have stopped here: a holder refused a replica)."""
    busy: bool
    """A transfer of an earlier save is in flight or waiting."""
    acked: frozenset[int]
    """The save sequences of this rank's own saves, at or after the anchor, that every holder stored and kept."""
    pinned: int
    """Bytes a keep of each file this rank keeps (its snapshot, the replicas it holds) may pin beyond today."""
    free: int
    """Bytes free in this rank's memory tier."""
    node: int = -1
    """This rank's node: ranks of one node share its memory tier's free space. ``-1``: a node of its own."""


@dataclass(frozen=True)
class Gate:
    """Every rank's answer: replicate this save or not, and the anchor (keeps below it go); ``anchor`` ``None``: keep
    nothing (``short`` then names the first node without room by its first rank: ``(rank, bytes needed by the
    node's ranks together, bytes free)``)."""

    replicate: bool
    anchor: Optional[int]
    short: Optional[tuple[int, int, int]] = None


def decide(votes: Sequence[Vote]) -> Gate:
    """The gate of one save from every rank's vote (in rank order)."""
    replicating = [v for v in votes if v.replicating]
    replicate = bool(replicating) and not any(v.busy for v in replicating)
    short = _short(votes)
    if short is not None or not replicating:
        return Gate(replicate, None, short)
    common = frozenset.intersection(*(v.acked for v in replicating))
    return Gate(replicate, max(common, default=-1))


def _short(votes: Sequence[Vote]) -> Optional[tuple[int, int, int]]:
    """The first node whose ranks' keeps together need more than its free space: ``(its first rank, bytes needed,
    bytes free)``; ``None`` when every node has room."""
    nodes: dict[object, list[int]] = {}
    for rank, v in enumerate(votes):
        nodes.setdefault(v.node if v.node >= 0 else ("rank", rank), []).append(rank)
    for ranks in nodes.values():
        needed, free = sum(votes[r].pinned for r in ranks), min(votes[r].free for r in ranks)
        if free < needed:
            return ranks[0], needed, free
    return None
