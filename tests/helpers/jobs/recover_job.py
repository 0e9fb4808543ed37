"""One rank of a two-process gloo group ("two nodes, one rank each") that relaunches into ``MemoryTier.choose``
after the losses a test names, and records what it chose.

Usage: recover_job.py RANK PORT DIR SCENARIO... For each scenario, in order: both ranks write their own memory
snapshot of step 8 (save 4) into their node's memory dir ``DIR/<scenario>/node<R>``, and the replica of the other
rank's (its file, byte for byte: what replication leaves); the durable checkpoint is of step 6. Then the scenario
takes away what a failure would and every rank calls ``choose``. Each rank writes ``DIR/<scenario>-rank<R>.json``:
the tier, the sources, the step and weights of the state it got, whether its snapshot file now equals the
other node's replica of it byte for byte, and the lines it logged and warned.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root holds ``tests``

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_resume.format.write import save_file
from lightning_resume.memory import transport
from lightning_resume.memory.replicate import Ring
from lightning_resume.memory.store import MemoryStore, memory_root, replica_name, slot_key
from lightning_resume.memory.tier import MemoryTier

STEP, SEQ, DURABLE = 8, 4, 6


def weights(rank: int) -> torch.Tensor:
    return torch.arange(5, dtype=torch.float32) + 100 * rank + STEP


def node_dir(base: Path, rank: int) -> Path:
    return base / f"node{rank}"


def own_file(base: Path, rank: int, key: str) -> Path:
    return Path(memory_root(str(node_dir(base, rank)))) / key / f"rank-{rank}-of-2.safetensors"


def replica_file(base: Path, holder: int, owner: int, key: str) -> Path:
    return Path(memory_root(str(node_dir(base, holder)))) / key / replica_name(owner, 2)


def prepare(base: Path, rank: int, group: Any) -> tuple[MemoryTier, str, str]:
    """Every rank: its snapshot, then (both written) the other rank's as its replica; the durable checkpoint."""
    directory, run = str(base / "ckpt"), f"run-{base.name}"
    tier = MemoryTier(str(node_dir(base, rank)), replicas=1)
    tier.directory, tier.rank, tier.world_size = directory, rank, 2
    tier.store = MemoryStore(tier.root, slot_key(directory), rank, 2, asynchronous=False)
    tier.ring = Ring(1, (1 - rank,), (1 - rank,), group)
    state = {"global_step": STEP, "w": weights(rank), "callbacks": {"ExactResume": {"memory_run": run}}}
    tier.store.save(state, STEP, SEQ, run)
    dist.barrier()
    theirs = own_file(base, 1 - rank, tier.store.key).read_bytes()
    tier.store.write_received(replica_name(1 - rank, 2), len(theirs), [memoryview(theirs)])
    durable = base / "ckpt" / f"epoch=0-step={DURABLE}.ckpt"
    if rank == 0:
        durable.parent.mkdir(parents=True, exist_ok=True)
        save_file({"global_step": DURABLE, "callbacks": {"ExactResume": {"memory_run": run}}}, str(durable))
    dist.barrier()
    return tier, run, str(durable)


def lose_node(base: Path, rank: int) -> Callable[[MemoryTier, int], None]:
    def lose(tier: MemoryTier, me: int) -> None:
        if me == rank:
            shutil.rmtree(node_dir(base, rank))

    return lose


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # in the last tensor's bytes: its checksum fails, the header holds
    path.write_bytes(bytes(data))


def scenario(name: str, base: Path) -> Callable[[MemoryTier, int], None]:
    """What the failure of ``name`` takes away (or breaks) on rank ``me``, after ``prepare``."""
    lose0, lose1 = lose_node(base, 0), lose_node(base, 1)

    def both(tier: MemoryTier, me: int) -> None:
        lose0(tier, me)
        lose1(tier, me)

    def corrupt_replica(tier: MemoryTier, me: int) -> None:
        lose1(tier, me)
        if me == 0:
            flip_byte(replica_file(base, 0, 1, tier.store.key))

    def replica_vanishes(tier: MemoryTier, me: int) -> None:  # after it was offered, before it is sent
        lose1(tier, me)
        if me == 0:
            tier.store.open_committed = lambda name=None: None  # type: ignore[method-assign]

    def damaged_in_transit(tier: MemoryTier, me: int) -> None:
        lose1(tier, me)
        if me == 1:
            write = tier.store.write_received

            def flipped(name: str, nbytes: int, chunks: Iterator[memoryview], **options: Any) -> str:
                data = bytearray(b"".join(bytes(c) for c in chunks))
                data[-3] ^= 0xFF
                return write(name, nbytes, [memoryview(bytes(data))], **options)

            tier.store.write_received = flipped  # type: ignore[method-assign]

    return {
        "own": lambda tier, me: None,
        "node1_lost": lose1,
        "node0_lost": lose0,
        "both_lost": both,
        "corrupt_replica": corrupt_replica,
        "replica_vanishes": replica_vanishes,
        "damaged_in_transit": damaged_in_transit,
    }[name]


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run_scenario(name: str, directory: Path, rank: int, group: Any) -> None:
    base = directory / name
    tier, run, durable = prepare(base, rank, group)
    scenario(name, base)(tier, rank)
    dist.barrier()
    lines = Lines()
    logging.getLogger("lightning.pytorch").addHandler(lines)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        chosen = tier.choose(durable)
    logging.getLogger("lightning.pytorch").removeHandler(lines)
    got: dict[str, Any] = {"tier": tier.resumed_tier, "sources": tier.sources, "lines": lines.lines}
    got["warned"] = [str(w.message) for w in warned]
    if isinstance(chosen, tuple):
        path, checkpoint = chosen
        got.update(step=checkpoint["global_step"], weights_equal=bool(torch.equal(checkpoint["w"], weights(rank))))
        replica = replica_file(base, 1 - rank, rank, tier.store.key)
        got["file_is_the_replica"] = replica.exists() and Path(path).read_bytes() == replica.read_bytes()
    else:
        got["durable"] = chosen
    (directory / f"{name}-rank{rank}.json").write_text(json.dumps(got))
    dist.barrier()


def main(rank: int, port: int, directory: Path, names: list[str], scenario: Callable[..., Any] = run_scenario) -> None:
    """Rank ``rank`` of the 2-process gloo job: each scenario of ``names`` in turn (``scenario(name, directory,
    rank, group)``; another job's scenarios reuse this launch)."""
    torch.set_num_threads(1)
    rank_zero_only.rank = rank  # as Lightning's strategy sets it: rank 0 logs the run's lines
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = transport.transfer_group()
    for name in names:
        scenario(name, directory, rank, group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:])
