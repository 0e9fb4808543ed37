"""Save a checkpoint under one name in a loop through ``SafetensorsCheckpointIO(save="async",
writer="process")`` until killed or until a save reports a failed background write (run by
``tests/integration/test_async_writer_process.py``).

Usage: python tests/helpers/jobs/async_writer_process_loop.py EVENTS TARGET NUMEL. Step ``s`` saves
``{"w": a NUMEL-element tensor of s, "step": s}`` to TARGET; each background write is logged to EVENTS as
``begin s`` when it is handed to the writer process and ``end s`` once that reported it committed. An
``AsyncWriteError`` is logged as one ``error <message>`` line, and the job exits with status 3.
"""

from __future__ import annotations

import sys

import torch

from lightning_resume import AsyncWriteError
from tests.helpers.jobs.async_save_loop import Logged  # each write logged around ``_commit``


def main(events: str, target: str, numel: int) -> int:
    torch.set_num_threads(1)
    io = Logged(events, writer="process")
    w = torch.zeros(numel)
    try:
        for step in range(1, 100_000):
            w.fill_(step)
            io.save_checkpoint({"w": w, "step": step}, target)
    except AsyncWriteError as err:
        io.log.write("error " + str(err).replace("\n", " ") + "\n")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
