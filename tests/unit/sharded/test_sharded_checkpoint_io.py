"""``ShardedCheckpointIO`` in one process (its 2-process Lightning fits: tests/integration/test_sharded_lightning.py)."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_resume.io.sharded_strategy import ShardedCheckpointIO

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_removing_a_checkpoint_uncommits_it_first(tmp_path):
    from lightning_resume import save_sharded

    directory = save_sharded({"w": torch.ones(2)}, str(tmp_path / "a.ckpt"), step=1)
    ShardedCheckpointIO().remove_checkpoint(directory)
    assert not os.path.exists(directory)
