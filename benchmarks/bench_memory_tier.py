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
``SafetensorsCheckpointIO`` has ``save="overlapped"``): blocked at the save plus at the barrier before the
next optimizer step, while the copy of the weights and moments runs beside the forward and backward.
Medians, spreads (min-max) and the ratios to the memcpy of the same run: absolute times swing on a
shared machine, ratios less.

Then ``--both``: at each step of the same loop, a durable async save (``SafetensorsCheckpointIO``) and then a
memory snapshot of the same state, as ``ExactResume`` takes them at a durable save: the snapshot copying the
state again, against the snapshot writing the durable save's staging (one copy for both tiers).

Usage: ``python benchmarks/bench_memory_tier.py --size-mb 600 --repeats 5``;
``--model --size-mb 300 --repeats 12`` for the overlapped rows; ``--both --size-mb 300 --repeats 12``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.flat_state import flat_state, memcpy_seconds, model_state, size_parser
from lightning_resume import SafetensorsCheckpointIO
from lightning_resume.format.write import save_file
from lightning_resume.memory.store import MemoryStore
from lightning_resume.schedule.options import DEFAULT_MEMORY_DIR


def main() -> None:
    parser = size_parser(__doc__, size_mb=600, repeats=5)
    parser.add_argument("--shm-root", default=DEFAULT_MEMORY_DIR)
    parser.add_argument("--disk-dir", default=None, help="where the durable save goes (default: a temp dir)")
    parser.add_argument("--model", action="store_true", help="the overlapped rows: a model + AdamW in a training loop")
    parser.add_argument("--both", action="store_true", help="a durable save and a memory snapshot at one step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shm = tempfile.mkdtemp(prefix="bench-memory-tier-", dir=args.shm_root)
    disk = tempfile.mkdtemp(prefix="bench-memory-tier-", dir=args.disk_dir)
    try:
        if args.both:
            run_both(args.size_mb, args.repeats, shm, disk)
        elif args.model:
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
    state = model_state(size_mb)
    stores = {
        "memory, async (C1)": MemoryStore(shm, "async", rank=0, world_size=1),
        "memory, overlap_copy (C1)": MemoryStore(shm, "overlap", rank=0, world_size=1, overlap_copy=True),
    }
    nbytes = state.nbytes
    times: Dict[str, List[float]] = {"memcpy": [], **{name: [] for name in stores}}
    for i in range(repeats + 1):
        memcpy = state.memcpy_seconds()
        for name, store in stores.items():
            checkpoint = state.checkpoint()
            started = time.perf_counter()
            store.save(checkpoint, step=i, seq=i + 1, run="bench")
            blocked = time.perf_counter() - started
            state.step()  # the next forward/backward overlaps the copy; its optimizer step's pre-hook is the barrier
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


def run_both(size_mb: int, repeats: int, shm: str, disk: str) -> None:
    """Blocked at a step that takes a durable save and then a memory snapshot of the same state (what
    ``ExactResume`` does at each durable save with the memory tier on): the snapshot copying the state again,
    against the snapshot writing the durable save's staging (``staging.lending``). With ``overlap_copy``, the save plus
    the barrier of each. The same training loop as ``--model``."""
    state = model_state(size_mb)
    rows = {}
    for overlap in (False, True):
        for borrow in (False, True):
            name = f"{'overlap_copy' if overlap else 'async'}, {'one copy' if borrow else 'copied twice'}"
            io = SafetensorsCheckpointIO(save="overlapped" if overlap else "async")
            lending = io.lend_staging() if borrow else None
            key = f"both-{int(overlap)}{int(borrow)}"
            rows[name] = (io, MemoryStore(shm, key, rank=0, world_size=1, overlap_copy=overlap), lending)
    times: Dict[str, List[float]] = {"memcpy": [], **{name: [] for name in rows}}
    borrowed: Dict[str, int] = {}
    for i in range(repeats + 1):
        memcpy = state.memcpy_seconds()
        for name, (io, store, lending) in rows.items():
            started = time.perf_counter()
            io.save_checkpoint(state.checkpoint(), os.path.join(disk, f"{name}.ckpt"))
            offer = lending.newest() if lending is not None else None
            store.save(state.checkpoint(), step=i, seq=i + 1, run="bench", borrow=offer)
            blocked = time.perf_counter() - started
            state.step()  # the barriers of both (overlap_copy) run at this optimizer step
            copies = [io._saver.stats.copy if io._saver is not None else None, store.last_copy]
            barrier = sum(c.barrier_seconds for c in copies if c is not None) if io.save == "overlapped" else 0.0
            store.wait()
            io.wait()
            borrowed[name] = store.last_borrowed_bytes
            if i:
                times[name].append(blocked + barrier)
        if i:
            times["memcpy"].append(memcpy)
    for io, store, _ in rows.values():
        store.free()
        io.teardown()
    load = os.getloadavg()
    print(f"durable save + memory snapshot at one step, model + AdamW, {state.nbytes / 1e6:.0f} MB, {repeats} steps")
    print(f"(load {load[0]:.2f}; bytes the snapshot wrote from the durable staging: {borrowed})")
    _table(times, times["memcpy"], state.nbytes / 2**20)


def _table(times: Dict[str, List[float]], memcpy: List[float], size_mb: float) -> None:
    base = statistics.median(memcpy)
    print(f"{'':28} {'median s':>9} {'min-max s':>14} {'x memcpy':>9} {'GB/s':>6}")
    for name, values in times.items():
        median = statistics.median(values)
        spread = f"{min(values):.4f}-{max(values):.4f}"
        print(f"{name:28} {median:9.4f} {spread:>14} {median / base:9.3f} {size_mb / 1024 / median:6.2f}")


if __name__ == "__main__":
    main()
