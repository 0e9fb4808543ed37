"""Save a checkpoint under one name in a loop through ``SafetensorsCheckpointIO(save="async")`` until
killed, so its background writer is busy nearly all the time (run by the kill-during-write tests).

Usage: python tests/helpers/jobs/async_save_loop.py EVENTS TARGET NUMEL [dedupe]. Step ``s`` saves
``{"w": a NUMEL-element tensor of s, "step": s, "tag": [s, "s"]}`` to TARGET (a path or an ``s3://`` URL);
with ``dedupe``, through ``SafetensorsCheckpointIO(dedupe=True)`` and with ``"frozen"``, the same NUMEL-element
tensor (``arange``) at every step;
each background write is logged to EVENTS as a ``begin s`` line before it and an ``end s`` line once it
is committed.
"""

from __future__ import annotations

import sys

import torch

from lightning_resume import SafetensorsCheckpointIO


class Logged(SafetensorsCheckpointIO):
    """Each background write logged around the plugin's documented ``_commit`` hook."""

    def __init__(self, events: str, writer: str = "thread", dedupe: bool = False) -> None:
        super().__init__(save="async", writer=writer, dedupe=dedupe)
        self.log = open(events, "a", buffering=1)

    def _commit(self, path, tree_json, tensors):
        self.log.write(f"begin {int(tensors['w'][0])}\n")
        super()._commit(path, tree_json, tensors)
        self.log.write(f"end {int(tensors['w'][0])}\n")


def main(events: str, target: str, numel: int, dedupe: bool = False) -> None:
    torch.set_num_threads(1)
    io = Logged(events, dedupe=dedupe)
    w, frozen = torch.zeros(numel), torch.arange(numel, dtype=torch.float32)
    for step in range(1, 100_000):
        w.fill_(step)
        extra = {"frozen": frozen} if dedupe else {}
        io.save_checkpoint({"w": w, "step": step, "tag": [step, str(step)], **extra}, target)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:] == ["dedupe"])
