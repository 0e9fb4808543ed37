"""Multi-process and kill-point jobs for the sharded checkpoint tests (each run as its own process group leader).

Train mode: a tiny FSDP2 (``fully_shard``) job on CPU/gloo that checkpoints with ``save_sharded``;
ranks are spawned with torch.multiprocessing. ``--resume`` starts from the newest committed
checkpoint; ``--stall-at STEP``: rank 0 stops just before committing that step's checkpoint,
announces it in OUT/paused and waits to be killed. ``--load-only DIR``: load on this world size and
dump the full weights. Rank 0 writes OUT/final.pt (full model and optimizer state, losses) at the end.

``--bad-meta`` (before training, in the same processes, to spare a start-up): the ranks try saves
that must fail on every rank at once (an unencodable value in the non-sharded part on both ranks or
on rank 1 only; rank 0 unable to create the directory), then one good save, all under OUT/bad-meta;
each rank writes what it raised and how long it took to OUT/bad-meta-<rank>.json. The process group
timeout is then 30 s, so a rank left waiting fails the job instead of hanging it.

Async (``--async``): saves go through one ``AsyncShardedSaver`` (committed at the next save and at
the end); ``--twin-sync`` first writes the same state synchronously under OUT/ckpt-sync;
``--slow-write S`` delays every background write by S seconds (so the next optimizer step surely
runs while the write is in flight); ``--stall-async-at STEP``: rank 0's background write of that
step pauses after DCP wrote the shards (announced in OUT/paused), to be SIGKILLed. Each rank writes
OUT/async-<rank>.json (in flight right after each save returned, blocked seconds).
``--async-faults`` (after training): background writes that fail on rank 1 must raise the same
error on every rank at the next save and at ``close``; results in OUT/async-faults-<rank>.json.

``--root URL`` checkpoints there instead of OUT/ckpt (an ``s3://`` prefix: the environment names the server).

``--resave PHASE`` (one process, no process group): commit ROOT/last at step 1, then re-save it at
step 2 and pause at PHASE (announced in OUT/paused) to be SIGKILLed there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
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
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_resume import load_sharded, newest_committed, save_sharded
from lightning_resume.sharded import background, marker
from lightning_resume.sharded import commit as commits
from lightning_resume.sharded.api import clean_uncommitted, load_meta
from tests.helpers.paths import free_port

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


def pause_here(out: str) -> None:
    """The test-only pause hook: announce, then wait to be killed."""
    open(os.path.join(out, "paused"), "w").close()
    time.sleep(600)


def save(args, model, optim, step: int) -> None:
    model_sd, optim_sd = get_state_dict(model, optim)
    rngs = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, torch.get_rng_state())
    if step == args.stall_at and dist.get_rank() == 0:
        commits.commit = lambda record: pause_here(args.out)
    state, name, meta = {"model": model_sd, "optim": optim_sd}, f"step-{step:04d}", {"step": step, "rng": rngs}
    if args.twin_sync:
        save_sharded(state, os.path.join(args.out, "ckpt-sync", name), step, meta=meta)
    if not args.async_:
        return save_sharded(state, os.path.join(args.root, name), step, meta=meta)
    handle = args.saver.save(state, os.path.join(args.root, name), step, meta=meta)
    args.report["in_flight"].append(args.saver.write_in_flight() and not handle.done())
    args.report["blocked"].append(args.saver.last_blocked_seconds)


def patch_background_write(args) -> None:
    """Test hooks around the background write: a delay, a pause after DCP wrote the shards."""
    write, digest = background._write_local, marker.digest_files

    def slow_write(staging, *rest):
        time.sleep(args.slow_write)
        return write(staging, *rest)

    def stalling_digest(directory, names):
        if f".step-{args.stall_async_at:04d}.partial-" in directory and dist.get_rank() == 0:
            pause_here(args.out)
        return digest(directory, names)

    background._write_local = slow_write
    marker.digest_files = stalling_digest


def train(rank: int, args) -> None:
    args.saver, args.report = background.AsyncShardedSaver(), {"in_flight": [], "blocked": []}
    if args.async_:
        patch_background_write(args)
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
    args.saver.close()
    with open(os.path.join(args.out, f"async-{rank}.json"), "w") as handle:
        json.dump(args.report, handle)
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


def bad_meta(rank: int, args) -> None:
    unencodable = torch.nn.MSELoss()
    cases = {
        "both": {"hyper_parameters": {"loss": unencodable}},
        "rank1": {"hyper_parameters": {"loss": unencodable if rank == 1 else "mse"}},
        "rank0-io": {"step": 1},
    }
    results, root = {}, os.path.join(args.out, "bad-meta")
    os.makedirs(root, exist_ok=True)
    for case, meta in cases.items():
        parent = os.path.join(root, "a-file") if case == "rank0-io" else root
        if case == "rank0-io" and rank == 0:
            open(parent, "w").close()  # rank 0 cannot create a directory under a file
        dist.barrier()
        began = time.monotonic()
        try:
            save_sharded({"w": torch.ones(2)}, os.path.join(parent, "ck"), 1, meta=meta)
            results[case] = ["saved", time.monotonic() - began]
        except Exception as err:
            results[case] = [f"{type(err).__name__}: {err}", time.monotonic() - began]
    save_sharded({"w": torch.ones(2)}, os.path.join(root, "good"), 2, meta={"step": 2})  # still in step
    with open(os.path.join(args.out, f"bad-meta-{rank}.json"), "w") as handle:
        json.dump(results, handle)


def async_faults(rank: int, args) -> None:
    """Background writes failing on rank 1 surface on both ranks: at the next save, then at ``close``."""
    root = os.path.join(args.out, "async-faults")
    write = background._write_local

    def failing(staging, *rest):
        out = write(staging, *rest)  # DCP's collective write completes on every rank first
        if rank == 1 and "/.bad-" in staging:
            raise OSError(28, "No space left on device (injected)")
        return out

    background._write_local = failing
    saver, results, state = background.AsyncShardedSaver(), {}, {"w": torch.full((4,), float(rank))}
    for case, action in (
        ("next-save", lambda: saver.save(state, os.path.join(root, "good-1"), 2)),
        ("close", lambda: saver.close()),
    ):
        saver.save(state, os.path.join(root, f"bad-{case}"), 1, meta={"case": case})
        try:
            action()
            results[case] = "no error"
        except Exception as err:
            results[case] = f"{type(err).__name__}: {err}"
    saver.save(state, os.path.join(root, "good-2"), 3)
    saver.close()
    with open(os.path.join(args.out, f"async-faults-{rank}.json"), "w") as handle:
        json.dump(results, handle)


def resave(args) -> None:
    """One process: commit ROOT/last at step 1, then re-save it at step 2 and pause at ``args.resave``."""

    def state(step: int) -> dict:
        return {"model": {"w": torch.full((64, 8), float(step))}, "step": step}

    last = os.path.join(args.root, "last")
    save_sharded(state(1), last, 1, meta={"step": 1})
    real_rename = os.rename
    if args.resave == "commit":  # shards written, marker not yet
        commits.commit = lambda record: pause_here(args.out)
    elif args.resave == "swap":  # committed in the staging directory, not swapped in yet
        commits._exchange = lambda a, b: pause_here(args.out)
    elif args.resave == "delete":  # swapped in, the replaced directory not yet deleted
        commits.discard = lambda path: pause_here(args.out)
    elif args.resave == "fallback-gap":  # no atomic exchange: between "old aside" and "new in place"
        commits._exchange = lambda a, b: False
        os.rename = lambda a, b: pause_here(args.out) if b == last else real_rename(a, b)
    save_sharded(state(2), last, 2, meta={"step": 2})


def worker(rank: int, args) -> None:
    torch.set_num_threads(1)
    timeout = timedelta(seconds=30) if args.bad_meta else timedelta(minutes=10)
    dist.init_process_group("gloo", rank=rank, world_size=args.world, timeout=timeout)
    try:
        if args.bad_meta:
            bad_meta(rank, args)
        (load_only if args.load_only else train)(rank, args)
        if args.async_faults:
            async_faults(rank, args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_now()


def exit_now() -> None:
    """Exit 0 without the interpreter's teardown: after a clean ``destroy_process_group`` gloo's threads still
    abort that teardown now and then (SIGABRT, "terminate called without an active exception")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--stall-at", type=int, default=-1)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--load-only")
    p.add_argument("--bad-meta", action="store_true")
    p.add_argument("--resave", choices=["commit", "swap", "delete", "fallback-gap"])
    p.add_argument("--async", dest="async_", action="store_true")
    p.add_argument("--twin-sync", action="store_true")
    p.add_argument("--slow-write", type=float, default=0.0)
    p.add_argument("--stall-async-at", type=int, default=-1)
    p.add_argument("--async-faults", action="store_true")
    p.add_argument("--root", help="checkpoint root (a URL) instead of OUT/ckpt")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.root is None:
        args.root = os.path.join(args.out, "ckpt")
        os.makedirs(args.root, exist_ok=True)
    if args.resave:
        return resave(args)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    mp.spawn(worker, args=(args,), nprocs=args.world)


if __name__ == "__main__":
    sys.exit(main())
