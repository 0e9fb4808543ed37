"""One rank of two "nodes" (one rank each, a memory dir each) replicating memory-tier snapshots to each other.

Usage: replicate_job.py RANK PORT DIR MODE. Each rank saves snapshots into ``DIR/node<RANK>`` with its
replicator on; MODE ``ring``: five snapshots, then each waits until its newest was acknowledged, stops and
writes ``DIR/rank<RANK>.txt`` (what it sent and received). MODE ``full``: rank 0's memory dir is reported full
to replicas (its free space looks like 1 KiB when a replica arrives), so rank 1's replica is refused. MODE
``killed``: rank 1 SIGKILLs itself after its second snapshot (its node is lost); rank 0 goes on saving, then stops.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Iterable

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root holds ``tests``

import torch
import torch.distributed as dist

from lightning_resume.memory import replicate
from lightning_resume.memory import store as memory_store
from lightning_resume.memory.store import MemoryStore, memory_root


def main(rank: int, port: int, directory: Path, mode: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    store = MemoryStore(memory_root(str(directory / f"node{rank}")), "0123456789abcdef", rank, world_size=2)
    ring = replicate.ring(None, num_nodes=2, rank=rank, world_size=2)
    if mode == "full" and rank == 0:
        store.write_received = _full(store.write_received)  # type: ignore[method-assign]
    replicator = replicate.start(store, ring)
    assert replicator is not None
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step in range(1, 6):
            state = {"w": torch.full((50_000,), float(step + 100 * rank)), "step": step}
            store.save(state, step=step, seq=step, run="r", after_commit=replicate.after_commit(replicator))
            if mode == "killed":
                store.wait()
                time.sleep(0.5)  # the transfer of this snapshot goes on meanwhile
                if rank == 1 and step == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
        store.wait()
        deadline = time.monotonic() + 120
        while mode == "ring" and (replicator.last_transfer is None or replicator.last_transfer.seq != 5):
            assert time.monotonic() < deadline, "the newest snapshot was never acknowledged"
            time.sleep(0.01)
        if mode != "killed":
            dist.barrier()  # both sides' replicas are written: nothing more is in flight
        started = time.monotonic()
        ended = replicator.stop(timeout=60)
        print(f"stop took {time.monotonic() - started:.1f}s", flush=True)
    last = replicator.last_transfer
    lines = [f"ended {ended} enabled {replicator.enabled} sent {replicator.sent} received {replicator.received}"]
    lines.append(f"last {None if last is None else (last.nbytes, last.step, last.seq)}")
    lines += [f"warning {w.message}" for w in said]
    (directory / f"rank{rank}.txt").write_text("\n".join(lines))
    if mode != "killed":
        dist.destroy_process_group()


def _full(write: Callable[[str, int, Iterable[memoryview]], str]) -> Callable[[str, int, Iterable[memoryview]], str]:
    """``MemoryStore.write_received`` on a memory dir that looks nearly full."""

    def refuse(name: str, nbytes: int, chunks: Iterable[memoryview]) -> str:
        original = memory_store.free_bytes
        memory_store.free_bytes = lambda directory: 1024
        try:
            return write(name, nbytes, chunks)
        finally:
            memory_store.free_bytes = original

    return refuse


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
