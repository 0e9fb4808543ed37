"""Elastic resume: the rest of an interrupted epoch dealt out to another number of ranks, every sample once.

Pure policy over index lists; nothing here knows Lightning, loaders or processes.

A distributed sampler deals one permutation of the epoch round-robin: position ``j`` of rank ``r``'s order is
the epoch's position ``j * W + r``. After ``t_r`` samples trained on each old rank ``r``, the untrained rest
is every rank's order from ``t_r`` on, merged back in the epoch's order (by ``(j, r)``), without the samples
already trained and without repeats (the padding a sampler adds so that every rank gets as many). The rest
is then dealt round-robin to the ``W'`` new ranks exactly as ``DistributedSampler`` deals an epoch: with
the sampler's ``drop_last=False`` it is padded, by repeating its first samples, to a multiple of ``W'``
(every rank must train as many batches); with ``drop_last=True`` its last ``len % W'`` samples are left
out. Those are the only samples trained twice or not at all, and the report counts them. The same rule
applies to an epoch that an earlier elastic resume had already dealt (each rank's order is then its plan).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from torch.utils.data import Dataset, DistributedSampler

KEEP_GLOBAL_BATCH = "keep_global_batch"
"""``ExactResume(elastic=...)``: adjust gradient accumulation so that the global batch stays."""


@dataclass(frozen=True)
class RankOrder:
    """One old rank's indices for the interrupted epoch, in the order its sampler yields them, and how
    many of them it trained."""

    indices: Sequence[int]
    trained: int


@dataclass(frozen=True)
class Deal:
    """The rest of the epoch for each new rank, with the samples the equal split repeats or leaves out."""

    per_rank: list[list[int]]
    untrained: int
    padded: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class OrderSpec:
    """What a distributed sampler's order depends on (``DistributedSampler``'s arguments but the rank)."""

    length: int
    shuffle: bool
    seed: int
    drop_last: bool

    def indices(self, world: int, rank: int, epoch: int) -> list[int]:
        """Rank ``rank``'s order of epoch ``epoch`` on ``world`` ranks: torch's own sampler, asked."""
        sampler: DistributedSampler[int] = DistributedSampler(
            _Sized(self.length), num_replicas=world, rank=rank, shuffle=self.shuffle, seed=self.seed,
            drop_last=self.drop_last,
        )  # fmt: skip
        sampler.set_epoch(epoch)
        return list(sampler)

    def every_rank(self, world: int, epoch: int) -> list[list[int]]:
        """Every rank's ``indices`` on ``world`` ranks, the epoch's order made once: ``DistributedSampler.__iter__``'s
        rule (torch/utils/data/distributed.py: one permutation, padded by repeating it or cut to a multiple of
        ``world``, dealt round-robin), so that many ranks cost one order, not one each."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.length, generator=generator).tolist()
        else:
            order = list(range(self.length))
        if self.drop_last and self.length % world:
            total = (self.length - 1) // world * world  # torch's num_samples (ceil((n - W) / W)), times W
        else:
            total = -(-self.length // world) * world
        if total > len(order) and order:
            order = (order * -(-total // len(order)))[:total]
        return [order[r:total:world] for r in range(world)]


class _Sized(Dataset[int]):
    """A dataset of ``n`` samples for ``DistributedSampler``, which reads only its length."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def untrained(orders: Sequence[RankOrder]) -> list[int]:
    """The samples no old rank trained, in the epoch's order, each once."""
    trained = {i for order in orders for i in order.indices[: order.trained]}
    longest = max((len(order.indices) for order in orders), default=0)
    rest: list[int] = []
    for j in range(longest):
        for order in orders:
            if order.trained <= j < len(order.indices):
                index = order.indices[j]
                if index not in trained:
                    trained.add(index)
                    rest.append(index)
    return rest


def deal(rest: Sequence[int], world: int, drop_last: bool) -> Deal:
    """``rest`` dealt round-robin to ``world`` ranks, equal in count (``DistributedSampler``'s rule)."""
    if world < 1:
        raise ValueError(f"world size must be at least 1, got {world}")
    rest = list(rest)
    count = len(rest)
    padded: list[int] = []
    dropped: list[int] = []
    remainder = len(rest) % world
    if remainder and drop_last:
        dropped = rest[len(rest) - remainder :]
        rest = rest[: len(rest) - remainder]
    elif remainder and rest:
        need = world - remainder
        padded = (rest * (need // len(rest) + 1))[:need]
        rest = rest + padded
    return Deal([rest[r::world] for r in range(world)], count, padded, dropped)


def epoch_batches(samples: int, batch_size: int, drop_last: bool) -> int:
    """Batches a rank's loader makes of ``samples`` (its ``drop_last`` drops a last partial batch)."""
    return samples // batch_size if drop_last else -(-samples // batch_size)


def accumulation(old_world: int, old_accumulate: int, new_world: int) -> int:
    """The gradient accumulation on ``new_world`` ranks that keeps the global batch; ``ValueError`` with the
    numbers when none does."""
    total = old_world * old_accumulate
    if total % new_world:
        raise ValueError(
            f"elastic='keep_global_batch': {old_world} ranks x accumulate_grad_batches={old_accumulate} ="
            f" {total} batches per optimizer step, which {new_world} ranks cannot share equally; relaunch on a"
            f" world size that divides {total}, or pass elastic=True to keep the per-rank batch instead"
        )
    return total // new_world


def old_rank_for(new_rank: int, old_world: int) -> int:
    """The old rank whose saved state (RNG, metrics, per-rank buffers) new rank ``new_rank`` starts from."""
    return new_rank % old_world


def derived_seed(rng: Mapping[str, Any], old_world: int, new_world: int, new_rank: int) -> int:
    """The seed of every RNG stream of new rank ``new_rank >= old_world``: a digest of the saved torch CPU
    stream of rank ``new_rank % old_world`` and of the move, so that no two ranks draw the same numbers and
    the same elastic resume always draws the same."""
    state = rng["torch"]
    data = state.numpy().tobytes() if isinstance(state, torch.Tensor) else bytes(state)
    tag = f"lightning-resume elastic {old_world}->{new_world} rank {new_rank}".encode()
    return int.from_bytes(hashlib.blake2b(tag + data, digest_size=8).digest(), "little") & (2**63 - 1)
