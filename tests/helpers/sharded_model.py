"""The trainee's network under ``ShardedModelParallelStrategy`` (``jobs/trainee.py`` cfg ``sharded``): sharded in
``configure_model`` as Lightning's model-parallel docs write it, and its state gathered whole for ``final.pt``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def shard(net: nn.Sequential, root: nn.Module, mesh: Any) -> None:
    """Tensor parallel over ``mesh["tensor_parallel"]`` (first Linear by columns, last by rows) when it has more
    than one rank; then each Linear and the root ``fully_shard``-ed over ``mesh["data_parallel"]`` when it has."""
    linears = [i for i, layer in enumerate(net) if isinstance(layer, nn.Linear)]
    if mesh["tensor_parallel"].size() > 1:
        plan = {str(linears[0]): ColwiseParallel(), str(linears[-1]): RowwiseParallel()}
        parallelize_module(net, mesh["tensor_parallel"], plan)
    if mesh["data_parallel"].size() > 1:
        for i in linears:
            fully_shard(net[i], mesh=mesh["data_parallel"])
        fully_shard(root, mesh=mesh["data_parallel"])


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The model's and the optimizer's state, whole, on every rank (collective)."""
    return get_model_state_dict(model, options=FULL), get_optimizer_state_dict(model, optimizer, options=FULL)
