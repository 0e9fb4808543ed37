"""The trainee (``trainee.py``) fine-tuning a model whose first layer is frozen, as a fine-tune of a pretrained
backbone is written in Lightning (``requires_grad_(False)`` on the backbone, the optimizer over the rest): the
frozen weight (1 MiB) never changes, the head and its AdamW moments change at every step. With
``io_args: {"dedupe": true}`` each save after the first writes only the head and its moments.
Usage: python dedupe_job.py CONFIG.json (the trainee's config).
"""

from __future__ import annotations

import json
import sys
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


def main(cfg: dict) -> None:
    trainee.Model = FrozenBackbone  # the trainee's run, with this model
    trainee.main(cfg)


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
