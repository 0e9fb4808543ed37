"""Save a checkpoint under one name in a loop through ``SafetensorsCheckpointIO(async_save=True,
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

from lightning_resume import AsyncWriteError, SafetensorsCheckpointIO


class Logged(SafetensorsCheckpointIO):
    """Each background write logged around the plugin's documented ``_commit`` hook."""

    def __init__(self, events: str) -> None:
        super().__init__(async_save=True, writer="process")
        self.log = open(events, "a", buffering=1)

    def _commit(self, path, tree_json, tensors):
        self.log.write(f"begin {int(tensors['w'][0])}\n")
        super()._commit(path, tree_json, tensors)
        self.log.write(f"end {int(tensors['w'][0])}\n")


def main(events: str, target: str, numel: int) -> int:
    torch.set_num_threads(1)
    io = Logged(events)
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
