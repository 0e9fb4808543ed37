"""Sharded save (every rank writes its shards, committed) vs rank-0 gather + single-file save, 2 processes.

    python benchmarks/bench_sharded.py                 # 8M parameters (32 MB fp32), 3 repeats
    python benchmarks/bench_sharded.py --params 64M --repeats 5

Same FSDP2-sharded state in both: ``save_sharded`` (DCP write on every rank, SHA-256 of each file,
commit marker) and raw ``dcp.save`` (no commit protocol, for the cost of ours) against
``get_model_state_dict(full_state_dict=True)`` gathered to rank 0 then ``torch.save`` + fsync.
Prints median seconds and the ratio gather/sharded. CPU, gloo, one thread per process.
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
from lightning_resume.sharded import save_sharded  # noqa: E402


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


def worker(rank: int, params: int, repeats: int, root: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    width = 1024
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(max(1, params // width**2))])
    mesh = init_device_mesh("cpu", (2,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    times = {"sharded (ours)": [], "raw dcp.save": [], "rank-0 gather + torch.save": []}
    for i in range(repeats):
        state = {"model": get_model_state_dict(model)}
        times["sharded (ours)"].append(timed(lambda: save_sharded(state, os.path.join(root, f"ours-{i}"), i)))
        times["raw dcp.save"].append(timed(lambda: dcp.save(state, checkpoint_id=os.path.join(root, f"raw-{i}"))))
        times["rank-0 gather + torch.save"].append(timed(lambda: gather_and_save(model, os.path.join(root, f"full-{i}.pt"))))
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


if __name__ == "__main__":
    main()
