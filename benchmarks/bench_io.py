"""Save/load speed of SafetensorsCheckpointIO against raw I/O and Lightning's TorchCheckpointIO.

The state is a transformer-like set of fp32 weights plus AdamW's exp_avg and exp_avg_sq (3x the
weights; 51.7M parameters give about 600 MB). Every method runs on the same tensors, interleaved,
``--repeats`` times; the table shows medians and ratios to the raw baseline of the same run:

- raw write+fsync: the tensors' bytes written to one file and fsync'd (no format, no checksums).
- raw read: the same file read into one reusable buffer (page cache warm, as for every read here).

``os.sync()`` runs (untimed) before each measurement, and each save's previous output is deleted
(untimed) first, so no write pays for truncating or freeing the last one (``discard`` mounts make
that slow). The order of the saves rotates from one repeat to the next (a write right after another
can find the disk still busy). The spread line gives the range of the per-repeat ratios to raw. TorchCheckpointIO does not fsync, so its save
time excludes the flush that every other save row includes.

Usage: ``python benchmarks/bench_io.py --size-mb 600 --repeats 3`` (defaults are small).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lightning_resume import SafetensorsCheckpointIO
from lightning_resume.io.framing import host_bytes


def make_state(size_mb: float, d: int = 512) -> Dict:
    """Weights of ~size_mb/3 MB in transformer shapes, plus AdamW moments (exp_avg, exp_avg_sq)."""
    budget = int(size_mb * 1e6 / 12)  # parameters: 4 bytes each, x3 with the two moments
    shapes, total = [], 0
    vocab = min(32000, max(1, budget // (4 * d)))
    shapes.append(("embed.weight", (vocab, d)))
    total += vocab * d
    layer = [("attn.qkv.weight", (3 * d, d)), ("attn.qkv.bias", (3 * d,)), ("attn.proj.weight", (d, d)), ("attn.proj.bias", (d,)),
             ("mlp.fc1.weight", (4 * d, d)), ("mlp.fc1.bias", (4 * d,)), ("mlp.fc2.weight", (d, 4 * d)), ("mlp.fc2.bias", (d,)),
             ("ln1.weight", (d,)), ("ln1.bias", (d,)), ("ln2.weight", (d,)), ("ln2.bias", (d,))]  # fmt: skip
    per_layer = sum(int(torch.Size(s).numel()) for _, s in layer)
    for i in range(max(0, (budget - total) // per_layer)):
        shapes += [(f"blocks.{i}.{name}", shape) for name, shape in layer]
        total += per_layer
    if budget > total:
        shapes.append(("head.weight", ((budget - total) // d or 1, d)))
    params = {n: torch.empty(s).uniform_(-1, 1) for n, s in shapes}
    state = {j: {"step": torch.tensor(100.0), "exp_avg": torch.empty_like(p).uniform_(), "exp_avg_sq": torch.empty_like(p).uniform_()}
             for j, p in enumerate(params.values())}  # fmt: skip
    groups = [
        {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False, "params": list(state)}
    ]
    return {
        "epoch": 1,
        "global_step": 100,
        "state_dict": params,
        "optimizer_states": [{"state": state, "param_groups": groups}],
    }


def all_tensors(state: Dict) -> List[torch.Tensor]:
    out = list(state["state_dict"].values())
    for s in state["optimizer_states"][0]["state"].values():
        out += [s["exp_avg"], s["exp_avg_sq"]]
    return out


def raw_write(views: List[memoryview], path: str) -> None:
    with open(path, "wb") as f:
        for v in views:
            f.write(v)
        f.flush()
        os.fsync(f.fileno())


def raw_read(path: str, buffer: bytearray) -> None:
    with open(path, "rb") as f:
        f.readinto(buffer)


def timed(fn: Callable[[], object]) -> float:
    os.sync()  # untimed: no method pays for the previous one's unflushed pages (TorchCheckpointIO does not fsync)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(size_mb: float, repeats: int, workdir: str) -> Dict[str, List[float]]:
    state = make_state(size_mb)
    views = [host_bytes(t) for t in all_tensors(state)]
    nbytes = sum(len(v) for v in views)
    read_buffer = bytearray(nbytes)  # reusable: fresh memory is slow on the project VM
    ours, verified_off, torch_io = (
        SafetensorsCheckpointIO(),
        SafetensorsCheckpointIO(verify=False, mmap=True),
        TorchCheckpointIO(),
    )
    ours_sha = SafetensorsCheckpointIO(checksum="sha256")
    paths = {k: os.path.join(workdir, f"{k}.ckpt") for k in ("raw", "ours", "sha", "torch")}

    destinations = all_tensors(state)  # restore copies into existing tensors, as load_state_dict does

    def restore(io, path):
        for dst, src in zip(destinations, all_tensors(io.load_checkpoint(path))):
            dst.copy_(src)

    methods = {
        "raw write+fsync": lambda: raw_write(views, paths["raw"]),
        "SafetensorsCheckpointIO save (crc32, default)": lambda: ours.save_checkpoint(state, paths["ours"]),
        "SafetensorsCheckpointIO save (sha256)": lambda: ours_sha.save_checkpoint(state, paths["sha"]),
        "TorchCheckpointIO save": lambda: torch_io.save_checkpoint(state, paths["torch"]),
        "raw read": lambda: raw_read(paths["raw"], read_buffer),
        "SafetensorsCheckpointIO load (verify crc32)": lambda: ours.load_checkpoint(paths["ours"]),
        "SafetensorsCheckpointIO load (verify sha256)": lambda: ours_sha.load_checkpoint(paths["sha"]),
        "SafetensorsCheckpointIO load (verify=False, mmap=True: lazy views)": lambda: verified_off.load_checkpoint(
            paths["ours"]
        ),
        "TorchCheckpointIO load": lambda: torch_io.load_checkpoint(paths["torch"]),
        "SafetensorsCheckpointIO load+copy into model (verify)": lambda: restore(ours, paths["ours"]),
        "SafetensorsCheckpointIO load+copy into model (verify=False, mmap=True)": lambda: restore(
            verified_off, paths["ours"]
        ),
        "TorchCheckpointIO load+copy into model": lambda: restore(torch_io, paths["torch"]),
    }
    outputs = {
        "raw write+fsync": "raw",
        "SafetensorsCheckpointIO save (crc32, default)": "ours",
        "SafetensorsCheckpointIO save (sha256)": "sha",
        "TorchCheckpointIO save": "torch",
    }
    times: Dict[str, List[float]] = {k: [] for k in methods}
    saves, loads = list(outputs), [k for k in methods if k not in outputs]
    for r in range(repeats):
        for name in (
            saves[r % len(saves) :] + saves[: r % len(saves)] + loads
        ):  # saves rotate: none always follows another
            fn = methods[name]
            if name in outputs and os.path.exists(paths[outputs[name]]):
                os.remove(
                    paths[outputs[name]]
                )  # untimed: each save writes a new file, none pays for freeing the old one
            times[name].append(timed(fn))
    times["_bytes"] = [float(nbytes)]
    return times


def report(times: Dict[str, List[float]]) -> str:
    nbytes = times.pop("_bytes")[0]
    med = {k: statistics.median(v) for k, v in times.items()}
    base = {"save": med["raw write+fsync"], "load": med["raw read"]}
    lines = [f"state: {nbytes / 1e6:.0f} MB of tensors ({nbytes / 12 / 1e6:.1f}M params + AdamW moments)", "",
             "| operation | median s | MB/s | vs raw |", "|---|---:|---:|---:|"]  # fmt: skip
    for name, t in med.items():
        kind = "save" if ("save" in name or "write" in name) else "load"
        lines.append(f"| {name} | {t:.3f} | {nbytes / 1e6 / t:.0f} | {t / base[kind]:.2f}x |")
    ours = [t / r for t, r in zip(times["SafetensorsCheckpointIO save (crc32, default)"], times["raw write+fsync"])]
    lines += [
        "",
        f"save (crc32) / raw write+fsync per repeat: min {min(ours):.2f}x, median {statistics.median(ours):.2f}x, max {max(ours):.2f}x",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size-mb",
        type=float,
        default=60.0,
        help="total tensor bytes (weights + 2 moments); 600 = the 51.7M-param case",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--dir", default=None, help="where to write (default: a temporary directory on the working disk)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    workdir = tempfile.mkdtemp(prefix="bench_io_", dir=args.dir or os.getcwd())
    try:
        print(report(run(args.size_mb, args.repeats, workdir)))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
