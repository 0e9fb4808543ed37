"""One rank of a two-process gloo group ("two nodes, one rank each") that relaunches into ``MemoryTier.choose`` with
kept saves in memory: save 4 (step 8) complete everywhere and kept, save 5 (step 10) newer but not complete.

Usage: keep_recover_job.py RANK PORT DIR SCENARIO... As ``recover_job.py`` prepares save 4 (each rank's snapshot and
the other's replica), each rank keeps both (``MemoryStore.keep``) and takes save 5 of its own; rank 1 also holds
rank 0's save 5 (rank 0's transfer arrived), rank 0 only rank 1's save 4 (rank 1's was in transit). Scenarios:
``node1_lost_in_transit``: node 1 is lost; ``rank1_behind``: rank 1 was killed before its save 5 committed (its
snapshot is save 4). Each rank writes ``DIR/<scenario>-rank<R>.json`` as ``recover_job.py`` does, plus what its slot
holds after ``choose``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root holds ``tests``

import torch
import torch.distributed as dist

from lightning_resume.memory.store import replica_name
from lightning_resume.memory.tier import MemoryTier
from tests.helpers.jobs import recover_job as job

NEWER_STEP, NEWER_SEQ = 10, 5


def take_newer(tier: MemoryTier, base: Path, rank: int, run: str, behind: bool) -> None:
    """Save 4 kept on every rank; save 5 taken (not by rank 1 when ``behind``) and, where it arrived, held."""
    store = tier.store
    assert store is not None
    store.keep(store.name, job.SEQ)
    store.keep(replica_name(1 - rank, 2), job.SEQ)
    if not (behind and rank == 1):
        state = {
            "global_step": NEWER_STEP,
            "w": job.weights(rank) + 1000,
            "callbacks": {"ExactResume": {"memory_run": run}},
        }
        store.save(state, NEWER_STEP, NEWER_SEQ, run)
        store.keep(store.name, NEWER_SEQ)
    dist.barrier()
    if rank == 1:  # rank 0's save 5 arrived here; rank 1's never reached rank 0
        theirs = job.own_file(base, 0, store.key).read_bytes()
        store.write_received(replica_name(0, 2), len(theirs), [memoryview(theirs)])
        store.keep(replica_name(0, 2), NEWER_SEQ)
    dist.barrier()


def run_scenario(name: str, directory: Path, rank: int, group: Any) -> None:
    base = directory / name
    tier, run, durable = job.prepare(base, rank, group)
    take_newer(tier, base, rank, run, behind=name == "rank1_behind")
    if name == "node1_lost_in_transit":
        job.lose_node(base, 1)(tier, rank)
    dist.barrier()
    lines = job.Lines()
    job.logging.getLogger("lightning.pytorch").addHandler(lines)
    chosen = tier.choose(durable)
    job.logging.getLogger("lightning.pytorch").removeHandler(lines)
    got: dict[str, Any] = {"tier": tier.resumed_tier, "sources": tier.sources, "lines": lines.lines}
    if isinstance(chosen, tuple):
        _, checkpoint = chosen
        got.update(step=checkpoint["global_step"], weights_equal=bool(torch.equal(checkpoint["w"], job.weights(rank))))
    else:
        got["durable"] = chosen
    slot = Path(tier.store.directory) if tier.store is not None else None
    got["slot"] = sorted(p.name for p in slot.iterdir() if not p.name.endswith(".owner")) if slot else []
    (directory / f"{name}-rank{rank}.json").write_text(json.dumps(got))
    dist.barrier()


if __name__ == "__main__":
    job.main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:], run_scenario)
