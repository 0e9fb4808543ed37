"""One rank of a two-process gloo group where rank 1 never reaches the agreement point.

Usage: arrive_job.py RANK PORT OUT. Rank 0 calls ``collective.all_arrive`` with a 3 s bound and writes
the error it raised (type and message) to ``OUT``; rank 1 sleeps past it, then exits.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root holds ``tests``

import torch.distributed as dist

from lightning_resume import collective


def main(rank: int, port: int, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if rank == 1:
        time.sleep(15)
        return
    started = time.monotonic()
    try:
        collective.all_arrive("the test's agreement point", 3.0)
        out.write_text("no error")
    except Exception as err:
        out.write_text(f"{type(err).__name__} after {time.monotonic() - started:.1f}s: {err}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
