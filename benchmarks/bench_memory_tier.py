"""C1, the blocking cost of a memory-tier snapshot, against a memcpy of the same state (and C2, a durable save).

Interleaved, ``--repeats`` times, for a state of ``--size-mb``: (1) a raw memcpy of the tensors into
preallocated buffers (the floor); (2) ``MemoryStore.save`` into a tmpfs (``/dev/shm``) as ExactResume
takes it: the training thread is blocked for the encode and one copy into reusable host buffers, a
worker writes the file and its checksum and renames it (not timed); (3) the same, synchronous: encode,
write into shared memory while a thread hashes, commit, all on the training thread; (4) a synchronous
durable save of the same state with ``write.save_file`` into a local directory (``--disk-dir``, fsync'd).

Then ``--model``: a real model and AdamW of about ``--size-mb`` (weights plus two moments) saved every
step of a CPU training loop, as the memory tier takes its snapshots: (a) the async store, blocked for one
copy, against (b) the store with ``overlap_copy=True`` (what ``ExactResume`` uses when the
``SafetensorsCheckpointIO`` has ``overlap_copy=True``): blocked at the save plus at the barrier before the
next optimizer step, while the copy of the weights and moments runs beside the forward and backward.
Medians, spreads (min-max) and the ratios to the memcpy of the same run: absolute times swing on a
shared machine, ratios less.

Usage: ``python benchmarks/bench_memory_tier.py --size-mb 600 --repeats 5``;
``--model --size-mb 300 --repeats 12`` for the overlapped rows.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.flat_state import flat_state, memcpy_seconds, size_parser
from lightning_resume.io.memory_tier import DEFAULT_MEMORY_DIR, MemoryStore
from lightning_resume.io.write import save_file


def main() -> None:
    parser = size_parser(__doc__, size_mb=600, repeats=5)
    parser.add_argument("--shm-root", default=DEFAULT_MEMORY_DIR)
    parser.add_argument("--disk-dir", default=None, help="where the durable save goes (default: a temp dir)")
    parser.add_argument("--model", action="store_true", help="the overlapped rows: a model + AdamW in a training loop")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shm = tempfile.mkdtemp(prefix="bench-memory-tier-", dir=args.shm_root)
    disk = tempfile.mkdtemp(prefix="bench-memory-tier-", dir=args.disk_dir)
    try:
        if args.model:
            run_model(args.size_mb, args.repeats, shm)
        else:
            run(args.size_mb, args.repeats, shm, disk)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


def run(size_mb: int, repeats: int, shm: str, disk: str) -> None:
    state = flat_state(size_mb)
    buffers = {k: torch.empty_like(v) for k, v in state["state_dict"].items()}
    stores = {
        "memory, async (C1)": MemoryStore(shm, "async", rank=0, world_size=1),
        "memory, sync": MemoryStore(shm, "sync", rank=0, world_size=1, asynchronous=False),
    }
    times: dict[str, list[float]] = {"memcpy": [], **{name: [] for name in stores}, "durable save (C2)": []}
    for step in range(repeats):
        times["memcpy"].append(memcpy_seconds(state, buffers))
        for name, store in stores.items():
            started = time.perf_counter()
            store.save(state, step=step, seq=step, run="bench")
            times[name].append(time.perf_counter() - started)
            store.wait()  # not timed: the worker's write, off the training thread
        started = time.perf_counter()
        save_file(state, os.path.join(disk, "durable.ckpt"))
        times["durable save (C2)"].append(time.perf_counter() - started)
    for store in stores.values():
        store.free()
    print(f"state {size_mb} MB, {repeats} repeats (interleaved); shm {shm}, disk {disk}")
    _table(times, times["memcpy"], size_mb)


def run_model(size_mb: int, repeats: int, shm: str) -> None:
    """Blocked per memory snapshot in a training loop: one copy, against the overlapped copy (save + barrier)."""
    torch.manual_seed(0)
    width = 1024
    layers = max(1, int(size_mb * 1e6 / 3 / (width * width * 4)))  # weights + two AdamW moments ~ size_mb
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, width)
    stores = {
        "memory, async (C1)": MemoryStore(shm, "async", rank=0, world_size=1),
        "memory, overlap_copy (C1)": MemoryStore(shm, "overlap", rank=0, world_size=1, overlap_copy=True),
    }

    def step() -> None:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    step()
    tensors = [*model.state_dict().values()] + [t for st in opt.state.values() for t in st.values() if t.numel() > 1]
    nbytes = sum(t.nbytes for t in tensors)
    buffers = [torch.empty_like(t) for t in tensors]
    times: Dict[str, List[float]] = {"memcpy": [], **{name: [] for name in stores}}
    for i in range(repeats + 1):
        started = time.perf_counter()
        for dst, src in zip(buffers, tensors, strict=True):
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.nbytes)
        memcpy = time.perf_counter() - started
        for name, store in stores.items():
            checkpoint = {"state_dict": model.state_dict(), "optimizer": opt.state_dict()}
            started = time.perf_counter()
            store.save(checkpoint, step=i, seq=i + 1, run="bench")
            blocked = time.perf_counter() - started
            opt.zero_grad()
            model(x).sum().backward()  # the next forward/backward, overlapped with the copy
            opt.step()  # its pre-hook is the barrier of an overlapped snapshot
            copy = store.last_copy
            barrier = copy.barrier_seconds if copy is not None and store is stores["memory, overlap_copy (C1)"] else 0.0
            store.wait()
            if i:  # the first save allocates the pool and encodes in full
                times[name].append(blocked + barrier)
        if i:
            times["memcpy"].append(memcpy)
    for store in stores.values():
        store.free()
    load = os.getloadavg()
    print(f"model + AdamW, {nbytes / 1e6:.0f} MB, {repeats} snapshots per store (interleaved), load {load[0]:.2f}")
    _table(times, times["memcpy"], nbytes / 2**20)


def _table(times: Dict[str, List[float]], memcpy: List[float], size_mb: float) -> None:
    base = statistics.median(memcpy)
    print(f"{'':28} {'median s':>9} {'min-max s':>14} {'x memcpy':>9} {'GB/s':>6}")
    for name, values in times.items():
        median = statistics.median(values)
        spread = f"{min(values):.4f}-{max(values):.4f}"
        print(f"{name:28} {median:9.4f} {spread:>14} {median / base:9.3f} {size_mb / 1024 / median:6.2f}")


if __name__ == "__main__":
    main()
