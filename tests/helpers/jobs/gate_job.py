"""One rank of two "nodes" (one rank each, a memory dir each) taking replicated memory snapshots through the gate
(``memory.replicate.agree``): which saves are replicated, the anchor, and the saves each slot keeps.

Usage: gate_job.py RANK PORT DIR. Saves 1 and 2 are replicated by both ranks; rank 1's transfer of save 2 is held
(its ``transport.send_file`` blocks, patched here), so at save 3 rank 1 is busy: nobody replicates save 3 and the
anchor is save 1. Then rank 1's transfer goes on; save 4 is replicated by both, the anchor is save 2. At save 5
rank 1's memory looks too small to keep anything more: no anchor, every kept save goes, one warning (rank 0).
Writes ``DIR/rank<RANK>.json``: per save, the gate's answer, the anchor, the kept saves in the slot, and warnings.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root holds ``tests``

import torch
import torch.distributed as dist

from lightning_resume.memory import replicate
from lightning_resume.memory.store import MemoryStore, memory_root

HELD_SEQ = 2


def _until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 120
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _hold(release: threading.Event) -> None:
    """Rank 1's transfer of save ``HELD_SEQ`` waits for ``release`` (a replica still in transit)."""
    send = replicate.transport.send_file

    def held(*args: Any, **kwargs: Any) -> int:
        if tuple(kwargs.get("record", ()))[:1] == (HELD_SEQ,):
            release.wait()
        return send(*args, **kwargs)

    replicate.transport.send_file = held  # type: ignore[assignment]


def _sent(replicator: replicate.Replicator) -> int:
    """The save sequence of the newest snapshot every holder acknowledged (``-1``: none)."""
    last = replicator.last_transfer
    return -1 if last is None else last.seq


def main(rank: int, port: int, directory: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    store = MemoryStore(memory_root(str(directory / f"node{rank}")), "0123456789abcdef", rank, world_size=2)
    ring = replicate.ring(None, num_nodes=2, rank=rank, world_size=2)
    release = threading.Event()
    if rank == 1:
        _hold(release)
    replicator = replicate.start(store, ring)
    assert replicator is not None
    saves = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for seq in range(1, 6):
            if seq == 5 and rank == 1:
                store.footprint = lambda owners=(): (1 << 20, 1024)  # type: ignore[method-assign]
            replicated = replicate.agree(replicator)
            state = {"w": torch.full((10_000,), float(seq + 100 * rank)), "step": seq}
            after = replicate.after_commit(replicator) if replicated else None
            store.save(state, step=2 * seq, seq=seq, run="r", after_commit=after)
            store.wait()
            if replicated and (rank, seq) == (1, HELD_SEQ):
                _until(lambda: replicator.activity()[1], "the held transfer never started")
            elif replicated:
                _until(lambda: _sent(replicator) == seq, f"save {seq} was never acknowledged")
            if seq == 3:
                release.set()  # the held transfer goes on: acknowledged before save 4 is voted on
                _until(lambda: _sent(replicator) == HELD_SEQ or rank == 0, "the held save was never acknowledged")
            dist.barrier()  # every replica of this save written where it was sent
            kept = sorted(k.name for k in store.kept(replicator.owners))
            saves.append({"seq": seq, "replicated": replicated, "anchor": replicator.anchor, "kept": kept})
        ended = replicator.stop(timeout=60)
    report = {"ended": ended, "saves": saves, "warnings": [str(w.message) for w in said]}
    (directory / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
