"""Two gloo processes on CPU: a rank's local shards through one file of our format and back (``sharded.local``).

``python local_shards_job.py OUT``: each rank builds a small model sharded with ``fully_shard`` (FSDP2, a
1-D mesh of 2: its first layer has 3 rows, so rank 1 holds one, and its last layer one row, so rank 1's shard of
it is empty) and, in a second phase, with tensor parallelism (``ColwiseParallel`` / ``RowwiseParallel``), trains
two AdamW steps, takes the state as Lightning's ``ModelParallelStrategy`` does (``get_model_state_dict`` /
``get_optimizer_state_dict``, ``cpu_offload=True``), turns it into local shards, writes it to
OUT/rank-<r>-<case>.safetensors, reads it back, and fills a model built from another seed with it. Each rank
writes OUT/result-<rank>.json: per case, whether every gathered weight and optimizer tensor is bitwise equal
to the trained one and what ``check`` said; and ``check``'s lines for a snapshot of the FSDP model against
the tensor-parallel one (another mesh at the same world size), a float64 model, and a snapshot missing a key.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root holds ``tests``

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_resume.format.read import load_file
from lightning_resume.format.write import save_file
from lightning_resume.sharded import local
from tests.helpers.compare import tensor_bits
from tests.helpers.paths import free_port

LIGHTNING = StateDictOptions(cpu_offload=True)  # as ModelParallelStrategy dumps a distributed checkpoint
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


CASES = {"fsdp": ("fsdp", 3), "fsdp4": ("fsdp", 4), "tp": ("tp", 4)}
"""Name: (how the model is sharded, its hidden width). 3 rows on 2 ranks is uneven; tensor parallel needs even."""


def build(
    kind: str, seed: int, hidden: int, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1)).to(dtype)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel" if kind == "fsdp" else "tensor_parallel",))
    if kind == "fsdp":
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype = torch.float32) -> None:
    for step in range(2):
        g = torch.Generator().manual_seed(step)  # every rank the same batch: enough for tensor parallel
        model(torch.randn(4, 8, generator=g, dtype=dtype)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def state(model: nn.Module, optimizer: torch.optim.Optimizer, options: StateDictOptions) -> dict:
    return {
        "state_dict": get_model_state_dict(model, options=options),
        "optimizer_states": [get_optimizer_state_dict(model, optimizer, options=options)],
        "global_step": 2,
    }


def bits(tree) -> object:
    if isinstance(tree, torch.Tensor):
        return tensor_bits(tree).hex()
    if isinstance(tree, dict):
        return {str(k): bits(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [bits(v) for v in tree]
    return tree


def round_trip(out: Path, rank: int, case: str) -> dict:
    kind, hidden = CASES[case]
    model, optimizer = build(kind, 0, hidden)
    train(model, optimizer)
    trained = bits(state(model, optimizer, FULL))
    path = out / f"rank-{rank}-{case}.safetensors"
    save_file(local.to_local(state(model, optimizer, LIGHTNING)), str(path))
    saved = load_file(str(path)).checkpoint
    fresh, fresh_optimizer = build(kind, 1, hidden)
    train(fresh, fresh_optimizer)  # other weights, other moments
    template = state(fresh, fresh_optimizer, StateDictOptions())
    problems = local.check(template, saved)
    local.fill(template, saved)
    set_model_state_dict(fresh, template["state_dict"])
    set_optimizer_state_dict(fresh, fresh_optimizer, template["optimizer_states"][0])
    empty = [p for p, t in local._tensors(saved) if t.numel() == 0]
    return {"problems": problems, "bitwise": bits(state(fresh, fresh_optimizer, FULL)) == trained, "empty": empty}


def mismatches(out: Path, rank: int) -> dict:
    saved = load_file(str(out / f"rank-{rank}-fsdp4.safetensors")).checkpoint
    tp, tp_optimizer = build("tp", 1, 4)
    train(tp, tp_optimizer)
    wide, wide_optimizer = build("fsdp", 1, 4, dtype=torch.float64)
    train(wide, wide_optimizer, torch.float64)
    same, same_optimizer = build("fsdp", 1, 4)
    train(same, same_optimizer)
    missing = dict(saved, state_dict={k: v for k, v in saved["state_dict"].items() if k != "2.bias"})
    return {
        "mesh": local.check(state(tp, tp_optimizer, StateDictOptions()), saved),
        "dtype": local.check(state(wide, wide_optimizer, StateDictOptions()), saved),
        "missing": local.check(state(same, same_optimizer, StateDictOptions()), missing),
    }


def run(rank: int, out: Path, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        result = {case: round_trip(out, rank, case) for case in CASES}
        result["mismatch"] = mismatches(out, rank)
        (out / f"result-{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    target = Path(sys.argv[1])
    target.mkdir(parents=True, exist_ok=True)
    mp.start_processes(run, (target, free_port()), nprocs=2, start_method="fork")  # torch is imported once
