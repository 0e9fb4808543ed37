"""A tiny FSDP2 (``fully_shard``) training job on CPU/gloo that checkpoints with ``save_sharded``.

Launched by tests/test_sharded_fsdp.py as its own process group leader; it spawns the ranks with
torch.multiprocessing. Modes: train (optionally ``--resume`` from the newest committed checkpoint,
optionally ``--stall-at STEP``: rank 0 stops just before committing that step's checkpoint, announces
it in OUT/stalled and waits to be killed) and ``--load-only DIR`` (load on this world size, dump the
full weights). Rank 0 writes OUT/final.pt (full model and optimizer state, losses) at the end.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_resume.sharded import clean_uncommitted, load_meta, load_sharded, newest_committed, save_sharded
from lightning_resume.sharded import commit as commits

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def build(world: int) -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def batch(step: int, rank: int) -> tuple:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def resume(args, model, optim) -> int:
    if dist.get_rank() == 0:
        clean_uncommitted(args.root)
    box = [newest_committed(args.root) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        return 0
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    load_sharded(state, box[0])
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    meta = load_meta(box[0])
    torch.set_rng_state(meta["rng"][dist.get_rank()])
    return meta["step"]


def save(args, model, optim, step: int) -> None:
    model_sd, optim_sd = get_state_dict(model, optim)
    rngs = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, torch.get_rng_state())
    if step == args.stall_at and dist.get_rank() == 0:
        def stall(record):
            open(os.path.join(args.out, "stalled"), "w").close()
            time.sleep(600)
        commits.commit = stall
    save_sharded({"model": model_sd, "optim": optim_sd}, os.path.join(args.root, f"step-{step:04d}"), step,
                 meta={"step": step, "rng": rngs})


def train(rank: int, args) -> None:
    model, optim = build(args.world)
    torch.manual_seed(100 + rank)  # dropout stream, per rank: restored on resume
    start = resume(args, model, optim) if args.resume else 0
    losses = []
    for step in range(start, args.steps):
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
        if (step + 1) % args.save_every == 0:
            save(args, model, optim, step + 1)
    dump(args, model, optim, losses)


def dump(args, model, optim, losses) -> None:
    full_model = get_model_state_dict(model, options=FULL)
    full_optim = get_optimizer_state_dict(model, optim, options=FULL) if optim is not None else {}
    if dist.get_rank() == 0:
        torch.save({"model": full_model, "optim": full_optim, "losses": losses}, os.path.join(args.out, "final.pt"))


def load_only(rank: int, args) -> None:
    model, _ = build(args.world)
    state = {"model": get_model_state_dict(model)}
    load_sharded(state, args.load_only)
    set_state_dict(model, (), model_state_dict=state["model"], optim_state_dict={})
    dump(args, model, None, [])


def worker(rank: int, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    try:
        (load_only if args.load_only else train)(rank, args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--stall-at", type=int, default=-1)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--load-only")
    args = p.parse_args(argv)
    args.root = os.path.join(args.out, "ckpt")
    os.makedirs(args.root, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    mp.spawn(worker, args=(args,), nprocs=args.world)


if __name__ == "__main__":
    sys.exit(main())
