"""C1, the blocking cost of a memory-tier snapshot, against a memcpy of the same state (and C2, a durable save).

Interleaved, ``--repeats`` times, for a state of ``--size-mb``: (1) a raw memcpy of the tensors into
preallocated buffers (the floor); (2) ``MemoryStore.save`` into a tmpfs (``/dev/shm``) as ExactResume
takes it: the training thread is blocked for the encode and one copy into reusable host buffers, a
worker writes the file and its CRC32 and renames it (not timed); (3) the same, synchronous: encode,
write into shared memory while a thread hashes, commit, all on the training thread; (4) a synchronous durable save of the same state with
``write.save_file`` into a local directory (``--disk-dir``, fsync'd). Medians, spreads (min-max) and
the ratios to the memcpy of the same run: absolute times swing on a shared machine, ratios less.

Usage: ``python benchmarks/bench_memory_tier.py --size-mb 600 --repeats 5``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.flat_state import flat_state, memcpy_seconds, size_parser
from lightning_resume.io.memory_tier import DEFAULT_ROOT, MemoryStore
from lightning_resume.io.write import save_file


def main() -> None:
    parser = size_parser(__doc__, size_mb=600, repeats=5)
    parser.add_argument("--shm-root", default=os.path.dirname(DEFAULT_ROOT))
    parser.add_argument("--disk-dir", default=None, help="where the durable save goes (default: a temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shm = tempfile.mkdtemp(prefix="bench-memory-tier-", dir=args.shm_root)
    disk = tempfile.mkdtemp(prefix="bench-memory-tier-", dir=args.disk_dir)
    try:
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
            store.save(state, step=step, seq=step)
            times[name].append(time.perf_counter() - started)
            store.wait()  # not timed: the worker's write, off the training thread
        started = time.perf_counter()
        save_file(state, os.path.join(disk, "durable.ckpt"))
        times["durable save (C2)"].append(time.perf_counter() - started)
    base = statistics.median(times["memcpy"])
    print(f"state {size_mb} MB, {repeats} repeats (interleaved); shm {shm}, disk {disk}")
    print(f"{'':24} {'median s':>9} {'min-max s':>14} {'x memcpy':>9} {'GB/s':>6}")
    for name, values in times.items():
        median = statistics.median(values)
        spread = f"{min(values):.3f}-{max(values):.3f}"
        print(f"{name:24} {median:9.3f} {spread:>14} {median / base:9.2f} {size_mb / 1024 / median:6.2f}")


if __name__ == "__main__":
    main()
