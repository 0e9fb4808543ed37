"""The trainee (``trainee.py``) fine-tuning a model whose first layer is frozen, as a fine-tune of a pretrained
backbone is written in Lightning (``requires_grad_(False)`` on the backbone, the optimizer over the rest): the
frozen weight (1 MiB) never changes, the head and its AdamW moments change at every step. With
``io_args: {"dedupe": true}`` each save after the first writes only the head and its moments.
``pause_in_save: N``: the N-th save blocks between its pack and its checkpoint file (``<out>/paused`` then exists).
Usage: python dedupe_job.py CONFIG.json (the trainee's config).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from torch import nn

if __name__ == "__main__":  # run as a script: the repo root holds ``tests``
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.helpers.jobs import trainee
from tests.helpers.jobs.trainee import DIM, Model

WIDTH = 32768
"""Features of the frozen layer: its weight is DIM x WIDTH float32 = 1 MiB."""


class FrozenBackbone(Model):
    def __init__(self, cfg: dict) -> None:
        super().__init__(cfg)
        self.net = nn.Sequential(nn.Linear(DIM, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1))
        self.net[0].requires_grad_(False)


def _pause_in_save(out: Path, nth: int) -> None:
    """At the ``nth`` save, block once its pack is committed and before its checkpoint file is written (the
    checkpoint file's commit, ``format.write.commit``, as ``cas.save`` calls it), so the test kills it there."""
    from lightning_resume.format import write

    commit, seen = write.commit, [0]

    def pausing(path, *args, **kwargs):
        seen[0] += 1
        if seen[0] == nth:
            (out / "paused").write_text(str(path))
            while True:
                time.sleep(1)
        return commit(path, *args, **kwargs)

    write.commit = pausing


def main(cfg: dict) -> None:
    trainee.Model = FrozenBackbone  # the trainee's run, with this model
    if cfg.get("pause_in_save"):
        _pause_in_save(Path(cfg["out"]), cfg["pause_in_save"])
    trainee.main(cfg)


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
