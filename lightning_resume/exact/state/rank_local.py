"""Module buffers that differ between the ranks of a replicated (DDP) run.

DDP keeps parameters equal on every rank, but not buffers: a ``BatchNorm`` layer's running statistics are
updated from each rank's own batch after the forward (``broadcast_buffers`` copies rank 0's in at the next
synchronised forward, not before a validation or an accumulation micro-batch). Lightning's checkpoint holds
rank 0's ``state_dict`` only, so a resume gives every rank rank 0's buffers, and rank 1's next validation sees
other statistics than the uninterrupted run's. Here each rank keeps, in its own part of the checkpoint, the
persistent buffers in which it differs from rank 0, and puts them back after Lightning's restore.

Mechanism only: which strategy replicates the module is the caller's decision.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from lightning_resume import collective
from lightning_resume.exact.state.fingerprint import digest


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's buffers that its ``state_dict`` holds (registered with ``persistent=True``)."""
    saved = set(module.state_dict(keep_vars=True))
    return {name: buffer for name, buffer in module.named_buffers() if name in saved}


def differing_from_rank_zero(module: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's persistent buffers whose values differ from rank 0's, as CPU copies (empty on rank 0).
    A collective: every rank calls it."""
    buffers = persistent_buffers(module)
    mine = {name: digest(buffer) for name, buffer in buffers.items()}
    reference = collective.broadcast(mine)
    return {name: buffers[name].detach().cpu().clone() for name in mine if reference.get(name) != mine[name]}


def put_back(module: nn.Module, saved: Mapping[str, torch.Tensor]) -> list[str]:
    """Copy this rank's saved buffers into ``module``; return one line per buffer that could not be
    (missing now, or another shape or dtype), for the caller to refuse or warn with."""
    buffers = persistent_buffers(module)
    problems = []
    for name, value in saved.items():
        target = buffers.get(name)
        if target is None:
            problems.append(f"rank-local buffer {name!r}: the module has no such persistent buffer now")
        elif target.shape != value.shape or target.dtype != value.dtype:
            problems.append(
                f"rank-local buffer {name!r}: checkpoint {tuple(value.shape)} {value.dtype},"
                f" now {tuple(target.shape)} {target.dtype}"
            )
        else:
            with torch.no_grad():
                target.copy_(value)
    return problems
