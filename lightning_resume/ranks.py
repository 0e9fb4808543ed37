"""Agreement between ranks for ``ExactResume``: one small collective at a time, every rank calling it.

The rule this module keeps: a decision taken on one rank (save now, refuse this checkpoint) is
never acted on alone, since a rank that saves or raises by itself leaves the others waiting in
their next collective.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist


def agreed(trainer: "pl.Trainer", lines: list[str]) -> list[str]:
    """Every rank's lines on every rank, so that all ranks refuse (or warn) together: a rank that raised
    alone would leave the others waiting in the next collective. Lines not seen on every rank say
    which ranks saw them."""
    per_rank = gather(lines, trainer.world_size)
    if len(per_rank) == 1:
        return lines
    out: dict[str, list[int]] = {}
    for rank, rank_lines in enumerate(per_rank):
        for line in rank_lines:
            out.setdefault(line, []).append(rank)
    return [line if len(ranks) == len(per_rank) else f"{line} (ranks {ranks})" for line, ranks in out.items()]


def gather(local: Any, world_size: Optional[int] = None) -> list[Any]:
    """Every rank's value, in rank order, on every rank (e.g. its state: the file is written by rank 0 only).

    ``world_size`` defaults to the process group's; one process (or none initialised) gets ``[local]``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return [local]
    world_size = dist.get_world_size() if world_size is None else world_size
    if world_size <= 1:
        return [local]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, local)
    return out


def max_over_ranks(trainer: "pl.Trainer", values: list[int]) -> list[int]:
    """Element-wise max over ranks: rank 0's decision reaches all, any rank's preemption flag counts."""
    if trainer.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return list(values)
    tensor = torch.tensor(values, dtype=torch.int64, device=trainer.strategy.root_device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [int(v) for v in tensor.tolist()]
