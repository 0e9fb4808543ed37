"""Save/load speed of SafetensorsCheckpointIO against raw I/O and Lightning's TorchCheckpointIO.

The state is a transformer-like set of fp32 weights plus AdamW's exp_avg and exp_avg_sq (3x the
weights; 51.7M parameters give about 600 MB). Every method runs on the same tensors, interleaved,
``--repeats`` times; the table shows medians and ratios to the raw baseline of the same run:

- raw write+fsync: the tensors' bytes written to one file and fsync'd (no format, no checksums).
- raw read (reused buffer): the same file read into one reusable buffer (page cache warm, as for every
  read here); every load row is compared with it. "raw read (fresh memory)" reads into a new
  allocation, the floor for any load that returns new tensors (page faults on fresh memory are slow
  on the project VM).
- saves and verified loads with each checksum (``xxh3-128``, the default, then ``crc32`` and
  ``sha256``), ``lightning_resume.verify`` of the default file (every byte hashed, nothing kept).

``os.sync()`` runs (untimed) before each measurement, and each save's previous output is deleted
(untimed) first, so no write pays for truncating or freeing the last one (``discard`` mounts make
that slow). The order of the saves rotates from one repeat to the next (a write right after another
can find the disk still busy), and so does the order of the loads. The ratio columns give the median and the range of the per-repeat ratios to raw. TorchCheckpointIO does not fsync, so its save
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
from lightning_resume.format.framing import host_bytes
from lightning_resume.io.verify import verify


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


def raw_read_fresh(path: str, nbytes: int) -> None:
    """The floor of any load that returns new tensors: the same read into freshly allocated memory."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    with open(path, "rb", buffering=0) as f:
        f.readinto(memoryview(buffer.numpy()))


CHECKSUMS = ("xxh3-128", "crc32", "sha256")  # the default first
SAVE_BASE, LOAD_BASE = "raw write+fsync", "raw read (reused buffer)"


def run(size_mb: float, repeats: int, workdir: str) -> Dict[str, List[float]]:
    state = make_state(size_mb)
    views = [host_bytes(t) for t in all_tensors(state)]
    nbytes = sum(len(v) for v in views)
    read_buffer = bytearray(nbytes)  # reusable: fresh memory is slow on the project VM
    ios = {c: SafetensorsCheckpointIO(checksum=c) for c in CHECKSUMS}
    unverified, lazy, torch_io = (
        SafetensorsCheckpointIO(verify=False),
        SafetensorsCheckpointIO(verify=False, mmap=True),
        TorchCheckpointIO(),
    )
    paths = {k: os.path.join(workdir, f"{k}.ckpt") for k in ("raw", "torch", *CHECKSUMS)}
    default = paths[CHECKSUMS[0]]

    destinations = all_tensors(state)  # restore copies into existing tensors, as load_state_dict does

    def restore(io, path):
        for dst, src in zip(destinations, all_tensors(io.load_checkpoint(path))):
            dst.copy_(src)

    saves = {SAVE_BASE: lambda: raw_write(views, paths["raw"])}
    for c in CHECKSUMS:
        saves[f"SafetensorsCheckpointIO save ({c}{', default' if c == CHECKSUMS[0] else ''})"] = lambda c=c: ios[
            c
        ].save_checkpoint(state, paths[c])
    saves["TorchCheckpointIO save"] = lambda: torch_io.save_checkpoint(state, paths["torch"])
    outputs = dict(zip(saves, ["raw", *CHECKSUMS, "torch"]))
    loads = {
        LOAD_BASE: lambda: raw_read(paths["raw"], read_buffer),
        "raw read (fresh memory)": lambda: raw_read_fresh(paths["raw"], nbytes),
    }
    for c in CHECKSUMS:
        loads[f"SafetensorsCheckpointIO load (verify {c})"] = lambda c=c: ios[c].load_checkpoint(paths[c])
    loads.update(
        {
            "SafetensorsCheckpointIO load (verify=False)": lambda: unverified.load_checkpoint(default),
            "SafetensorsCheckpointIO load (verify=False, mmap=True: lazy views)": lambda: lazy.load_checkpoint(default),
            f"lightning_resume.verify ({CHECKSUMS[0]})": lambda: verify(default),
            "TorchCheckpointIO load": lambda: torch_io.load_checkpoint(paths["torch"]),
            "SafetensorsCheckpointIO load+copy into model (verify)": lambda: restore(ios[CHECKSUMS[0]], default),
            "SafetensorsCheckpointIO load+copy into model (verify=False, mmap=True)": lambda: restore(lazy, default),
            "TorchCheckpointIO load+copy into model": lambda: restore(torch_io, paths["torch"]),
        }
    )
    times: Dict[str, List[float]] = {k: [] for k in (*saves, *loads)}
    order, rotation = list(saves), list(loads)
    for r in range(repeats):  # saves rotate (none always follows another), so do loads (fresh memory varies)
        for name in order[r % len(order) :] + order[: r % len(order)]:
            if os.path.exists(paths[outputs[name]]):
                os.remove(
                    paths[outputs[name]]
                )  # untimed: each save writes a new file, none pays for freeing the old one
            times[name].append(timed(saves[name]))
        for name in rotation[r % len(rotation) :] + rotation[: r % len(rotation)]:
            times[name].append(timed(loads[name]))
    times["_bytes"] = [float(nbytes)]
    return times


def report(times: Dict[str, List[float]]) -> str:
    nbytes = times.pop("_bytes")[0]
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [f"state: {nbytes / 1e6:.0f} MB of tensors ({nbytes / 12 / 1e6:.1f}M params + AdamW moments), "
             f"{len(times[LOAD_BASE])} repeats", "",
             "| operation | median s | MB/s | vs raw (median) | per-repeat ratio min-max |", "|---|---:|---:|---:|---:|"]  # fmt: skip
    for name, t in med.items():
        base = SAVE_BASE if ("save" in name or "write" in name) else LOAD_BASE
        ratios = [x / y for x, y in zip(times[name], times[base])]
        lines.append(
            f"| {name} | {t:.3f} | {nbytes / 1e6 / t:.0f} | {t / med[base]:.2f}x | {min(ratios):.2f}-{max(ratios):.2f}x |"
        )
    lines.append("")
    for c in CHECKSUMS:
        for name, base in (
            (f"SafetensorsCheckpointIO load (verify {c})", LOAD_BASE),
            (f"SafetensorsCheckpointIO save ({c}", SAVE_BASE),
        ):
            name = next(k for k in times if k.startswith(name))
            ratios = sorted(x / y for x, y in zip(times[name], times[base]))
            lines.append(f"{name} / {base}, per repeat: median {statistics.median(ratios):.2f}x, "
                         f"min {ratios[0]:.2f}x, max {ratios[-1]:.2f}x")  # fmt: skip
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
