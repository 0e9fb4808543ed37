"""Sharded save (every rank writes its shards, committed) vs rank-0 gather + single-file save, 2 processes.

    python benchmarks/bench_sharded.py                 # 8M parameters (32 MB fp32), 3 repeats
    python benchmarks/bench_sharded.py --params 64M --repeats 5

Same FSDP2-sharded state in both: ``save_sharded`` (DCP write on every rank, SHA-256 of each file,
commit marker) and raw ``dcp.save`` (no commit protocol, for the cost of ours) against
``get_model_state_dict(full_state_dict=True)`` gathered to rank 0 then ``torch.save`` + fsync.
Prints median seconds and the ratio gather/sharded. CPU, gloo, one thread per process.

Async: ``AsyncShardedSaver.save`` (the training thread's part: copy the local shards into reusable
host buffers) and its total until committed (``wait``), against a raw copy of the same local shards
into preallocated buffers (the floor for the blocked time) and ``dcp.async_save`` (torch's async path,
on its own gloo group; no commit protocol), blocked and total.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightning_resume import save_sharded
from lightning_resume.sharded.background import AsyncShardedSaver


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def gather_and_save(model: nn.Module, path: str) -> None:
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        with open(path, "wb") as handle:
            torch.save(full, handle)
            handle.flush()
            os.fsync(handle.fileno())


def split(save, finish) -> tuple:
    """(blocked, total) seconds of a save whose ``save`` returns early and ``finish`` waits for the rest."""
    dist.barrier()
    start = time.perf_counter()
    pending = save()
    blocked = time.perf_counter() - start
    finish(pending)
    dist.barrier()
    return blocked, time.perf_counter() - start


def raw_copy(state: dict, buffers: dict) -> None:
    """The floor for the blocked time: copy every local shard into a preallocated buffer."""
    for name, value in state["model"].items():
        local = value.to_local()
        buffers.setdefault(name, torch.empty_like(local)).copy_(local)


def async_times(state: dict, root: str, i: int, saver: AsyncShardedSaver, group, buffers: dict) -> dict:
    ours = split(lambda: saver.save(state, os.path.join(root, f"async-{i}"), i), lambda _: saver.wait())
    torch_async = split(
        lambda: dcp.async_save(state, checkpoint_id=os.path.join(root, f"dcp-async-{i}"), process_group=group),
        lambda future: future.result(),
    )
    return {
        "async sharded (ours): blocked": ours[0],
        "async sharded (ours): total": ours[1],
        "dcp.async_save: blocked": torch_async[0],
        "dcp.async_save: total": torch_async[1],
        "memcpy of local shards": timed(lambda: raw_copy(state, buffers)),
    }


def worker(rank: int, params: int, repeats: int, root: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    width = 1024
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(max(1, params // width**2))])
    mesh = init_device_mesh("cpu", (2,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    times = {"sharded (ours)": [], "raw dcp.save": [], "rank-0 gather + torch.save": []}
    saver, group, buffers = AsyncShardedSaver(), dist.new_group(backend="gloo"), {}
    for i in range(repeats):
        state = {"model": get_model_state_dict(model)}
        times["sharded (ours)"].append(timed(lambda: save_sharded(state, os.path.join(root, f"ours-{i}"), i)))
        times["raw dcp.save"].append(timed(lambda: dcp.save(state, checkpoint_id=os.path.join(root, f"raw-{i}"))))
        times["rank-0 gather + torch.save"].append(
            timed(lambda: gather_and_save(model, os.path.join(root, f"full-{i}.pt")))
        )
        for name, seconds in async_times(state, root, i, saver, group, buffers).items():
            times.setdefault(name, []).append(seconds)
    if rank == 0:
        results.update({k: statistics.median(v) for k, v in times.items()})
        results["params"] = sum(p.numel() for p in model.parameters()) * 1  # DTensor numel is the global size
    dist.destroy_process_group()


def parse_count(text: str) -> int:
    scale = {"K": 1e3, "M": 1e6, "B": 1e9}.get(text[-1].upper(), 1)
    return int(float(text.rstrip("KMBkmb")) * scale)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=parse_count, default=parse_count("8M"), help="model parameters (default 8M)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir on the default disk)")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(dir=args.dir) as root, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(args.params, args.repeats, root, results), nprocs=2)
        results = dict(results)
    mb = results.pop("params") * 4 / 1e6
    print(f"state: {mb:.0f} MB fp32 over 2 processes (gloo, CPU), median of {args.repeats}")
    for name, seconds in results.items():
        print(f"  {name:28s} {seconds:7.3f} s  {mb / seconds:8.0f} MB/s")
    ratio = results["rank-0 gather + torch.save"] / results["sharded (ours)"]
    print(f"  gather+single-file / sharded = {ratio:.2f}x")
    blocked, floor = results["async sharded (ours): blocked"], results["memcpy of local shards"]
    print(
        f"  async blocked / memcpy = {blocked / floor:.2f}x;  async blocked / sync sharded = "
        f"{blocked / results['sharded (ours)']:.3f}x;  dcp.async_save blocked / ours = "
        f"{results['dcp.async_save: blocked'] / blocked:.2f}x"
    )
    print(f"  async total / sync sharded = {results['async sharded (ours): total'] / results['sharded (ours)']:.2f}x")


if __name__ == "__main__":
    main()
