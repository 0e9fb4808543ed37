"""One rank of a two-process gloo group that moves files with ``memory.transport``.

Usage: transfer_job.py RANK PORT DIR. Rank 0 sends ``DIR/source.bin`` to rank 1 three times in small chunks
(record 11, 12, 13), then "nothing"; rank 1's sink drops the first transfer unread (as a holder refuses a
replica that does not fit), writes the second to ``DIR/received.bin`` and raises in the third, then receives
the "nothing" and writes ``DIR/rank1.txt`` with what it saw. Rank 0 writes the bytes it sent to ``DIR/rank0.txt``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root holds ``tests``

import torch
import torch.distributed as dist

from lightning_resume.memory import transport

CHUNK = 1000
"""Small chunks, so a file of a few KiB goes as many messages and a short last one."""


def sender(directory: Path) -> None:
    group = transport.transfer_group()
    source = str(directory / "source.bin")
    sent = [transport.send_file(source, 1, group, chunk_bytes=CHUNK, record=(10 + i, 7)) for i in (1, 2, 3)]
    transport.send_nothing(1, group)
    (directory / "rank0.txt").write_text(" ".join(map(str, sent)))


def receiver(directory: Path) -> None:
    group = transport.transfer_group()
    buffer = torch.empty(CHUNK, dtype=torch.uint8)  # reused by every transfer
    seen = []

    def refuse(nbytes: int, chunks: Iterator[memoryview]) -> str:
        seen.append(f"refused {nbytes} record {chunks.record[:2]}")  # type: ignore[attr-defined]
        return "refused"

    def keep(nbytes: int, chunks: Iterator[memoryview]) -> str:
        with open(directory / "received.bin", "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        seen.append(f"kept {nbytes} record {chunks.record[:2]}")  # type: ignore[attr-defined]
        return "kept"

    def fail(nbytes: int, chunks: Iterator[memoryview]) -> str:
        next(chunks)
        raise OSError("the sink failed after one chunk")

    results = [transport.recv_file(0, group, refuse, buffer), transport.recv_file(0, group, keep, buffer)]
    try:
        transport.recv_file(0, group, fail, buffer)
    except OSError as err:
        results.append(str(err))
    results.append(transport.recv_file(0, group, keep, buffer))  # "nothing": None
    (directory / "rank1.txt").write_text("\n".join([*seen, repr(results)]))


def main(rank: int, port: int, directory: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    (sender if rank == 0 else receiver)(directory)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
