"""Which memory-tier state each rank resumes from after a relaunch: a pure policy over what the ranks offer.

At a relaunch every rank says what it can reach (:class:`RankOffer`): its own verified snapshot, the verified
replicas of other ranks' snapshots it holds (``memory.replicate`` puts them there), the replicas it refused
and why, the saves it keeps of either (``RankOffer.kept``: the anchor, kept while a newer save was in transit),
and the step of the durable checkpoint it resolved. :func:`plan_recovery` picks the newest save
(step, sequence) that every rank can obtain and that is newer than the durable checkpoint; each rank's
state comes from its own snapshot when it has that save, else from the lowest rank holding a replica of
it (a current file before a kept one, :class:`RecoveryPlan`). When no save is complete, :class:`NoRecovery` says which rank's state is
missing at which step, and why, in one line: every rank then resumes from the durable tier. A snapshot
and its replicas are the same bytes (the owner's file), so a save is named by (step, sequence) alone.

Plain records in, a plan out: no files, no collectives, no Lightning (``memory.tier`` does those).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

Save = tuple[int, int]
"""(global step, save sequence): one save, the same on every rank."""


@dataclass(frozen=True)
class Held:
    """One verified snapshot a rank can read: its own (``owner`` is that rank) or a replica of ``owner``'s."""

    owner: int
    step: int
    seq: int
    saved_at: float
    path: str = ""
    """Where it lies on the rank that holds it (for messages)."""
    name: str = ""
    """Its file's name in the holding rank's slot (what a transfer or a reinstatement opens)."""
    kept: bool = False
    """A kept save (not the current file of its name): made current again, or sent, when a plan uses it."""

    @property
    def save(self) -> Save:
        """The save it is of: (global step, save sequence), the same on every rank for one save."""
        return (self.step, self.seq)


@dataclass(frozen=True)
class Refused:
    """A snapshot or replica a rank found but could not verify: whose, where, and why."""

    owner: int
    path: str
    reason: str


@dataclass(frozen=True)
class RankOffer:
    """What one rank can reach at a relaunch."""

    rank: int
    own: Optional[Held]
    replicas: tuple[Held, ...] = ()
    refused: tuple[Refused, ...] = ()
    durable_step: int = -1
    """The global step of the durable checkpoint this rank resolved; ``-1``: none."""
    kept: tuple[Held, ...] = ()
    """The kept saves it holds: of its own state (``owner`` is this rank) and of the replicas it holds."""


@dataclass(frozen=True)
class RecoveryPlan:
    """Every rank resumes from save (``step``, ``seq``); rank ``r``'s state is in the memory of ``sources[r]``."""

    step: int
    seq: int
    sources: tuple[int, ...]
    saved_at: float
    """Rank 0's save time of that save (the time ranks compare at the restore)."""
    paths: tuple[str, ...] = ()
    """``paths[r]``: where rank ``r``'s state lies on ``sources[r]``."""
    names: tuple[str, ...] = ()
    """``names[r]``: the file of rank ``r``'s state in the slot of ``sources[r]``."""
    kept: tuple[int, ...] = ()
    """The ranks whose state is a kept save on its source (made current again, or sent, from there)."""

    @property
    def own_kept(self) -> bool:
        """Whether some rank resumes from a kept save of its own (it is made its current snapshot first)."""
        return any(self.sources[r] == r for r in self.kept)

    @property
    def transfers(self) -> tuple[tuple[int, int], ...]:
        """``(holder, owner)`` for each rank whose state comes from a peer, by owner: the order every rank
        walks them in, so that each transfer's two ranks reach it together (no cycle can wait on itself)."""
        return tuple((holder, owner) for owner, holder in enumerate(self.sources) if holder != owner)

    @property
    def from_peers(self) -> bool:
        """Whether some rank's state comes from another rank's memory (a node was lost)."""
        return bool(self.transfers)


@dataclass(frozen=True)
class NoRecovery:
    """No save is complete in memory: why, in one line."""

    reason: str


Outcome = Union[RecoveryPlan, NoRecovery]

Holders = dict[Save, list[tuple[int, Held]]]
"""One owner's state: each save of it -> ``(holding rank, record)``, the owner itself first, then by rank."""


def plan_recovery(offers: Sequence[RankOffer], world_size: int, durable_step: int) -> Outcome:
    """The newest save every rank can obtain, newer than ``durable_step``: own snapshot first, else the lowest
    rank holding a replica. ``offers``: one per rank, in rank order. Raises ``ValueError`` on offers that do not
    describe ``world_size`` ranks (a caller's bug, never a state of the memory tier)."""
    _check(offers, world_size)
    where = _where_held(offers)
    saves = sorted({save for held in where for save in held}, reverse=True)
    for save in (s for s in saves if s[0] > durable_step):
        if all(save in held for held in where):
            return _plan(save, [held[save] for held in where])
    return NoRecovery(_why_none(offers, where, saves, durable_step))


def _check(offers: Sequence[RankOffer], world_size: int) -> None:
    if [o.rank for o in offers] != list(range(world_size)):
        raise ValueError(
            f"expected one offer per rank 0..{world_size - 1} in order, got ranks {[o.rank for o in offers]}"
        )
    for offer in offers:
        if offer.own is not None and offer.own.owner != offer.rank:
            raise ValueError(f"rank {offer.rank} offered rank {offer.own.owner}'s snapshot as its own")
        for held in offer.replicas:
            if held.owner == offer.rank or not 0 <= held.owner < world_size:
                raise ValueError(f"rank {offer.rank} offered a replica of rank {held.owner}")
        for held in offer.kept:
            if not 0 <= held.owner < world_size:
                raise ValueError(f"rank {offer.rank} offered a kept save of rank {held.owner}")


def _where_held(offers: Sequence[RankOffer]) -> list[Holders]:
    """Per owner rank, where each save of its state is held: the owner first (its current file, then a kept one),
    then the other ranks by rank (each its current replica, then a kept one); one record per rank and save."""
    where: list[Holders] = [{} for _ in offers]
    for offer in offers:
        own = [offer.own] if offer.own is not None else []
        for held in own + [k for k in offer.kept if k.owner == offer.rank]:
            _add(where[offer.rank], offer.rank, held)
    for offer in offers:
        for held in list(offer.replicas) + [k for k in offer.kept if k.owner != offer.rank]:
            _add(where[held.owner], offer.rank, held)
    return where


def _add(holders: Holders, rank: int, held: Held) -> None:
    at = holders.setdefault(held.save, [])
    if all(holder != rank for holder, _ in at):
        at.append((rank, held))


def _plan(save: Save, holders: list[list[tuple[int, Held]]]) -> RecoveryPlan:
    chosen = [hs[0] for hs in holders]  # the owner when it has the save, else the lowest holding rank
    return RecoveryPlan(
        step=save[0],
        seq=save[1],
        sources=tuple(rank for rank, _ in chosen),
        saved_at=chosen[0][1].saved_at,
        paths=tuple(held.path for _, held in chosen),
        names=tuple(held.name for _, held in chosen),
        kept=tuple(owner for owner, (_, held) in enumerate(chosen) if held.kept),
    )


def _why_none(offers: Sequence[RankOffer], where: list[Holders], saves: list[Save], durable: int) -> str:
    if not saves:
        refused = [_refusal(r, o.rank) for o in offers for r in o.refused]
        return "; ".join(refused) if refused else "no rank's memory holds a snapshot of this run"
    newest = saves[0]
    if newest[0] <= durable:
        return f"its newest step {newest[0]} is not newer than the durable checkpoint's step {durable}"
    missing = [owner for owner, held in enumerate(where) if newest not in held]
    return f"no rank holds every rank's state of step {newest[0]} (save {newest[1]}): " + "; ".join(
        _missing(owner, where[owner], offers) for owner in missing
    )


def _missing(owner: int, held: Holders, offers: Sequence[RankOffer]) -> str:
    """Why rank ``owner``'s state of the newest save is not at hand: what was refused, which other saves there are."""
    what = f"rank {owner}'s state"
    refused = [_refusal(r, o.rank) for o in offers for r in o.refused if r.owner == owner]
    others = [
        f"step {s[0]} (save {s[1]}) on rank(s) {[rank for rank, _ in held[s]]}" for s in sorted(held, reverse=True)
    ]
    if not refused and not others:
        return f"no verified snapshot on rank(s) [{owner}] and no replica of {what} on any rank"
    return f"{what} is missing: " + ", ".join(refused + ([f"only {', '.join(others)}"] if others else []))


def _refusal(refused: Refused, holder: int) -> str:
    kind = "snapshot" if refused.owner == holder else "replica"
    return f"rank {refused.owner}'s {kind} on rank {holder} ({refused.path}) failed verification: {refused.reason}"
