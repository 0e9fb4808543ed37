"""The replica count at setup: on one node a replica would stay with its owner, so ``replicas=1`` is refused
naming the option and the node count; the default there is no replica (no transfer group, no threads)."""

from __future__ import annotations

from pathlib import Path

import lightning
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_resume import ConfigurationError, ExactResume, MemoryTierOptions
from tests.helpers.models import TinyData, TinyModel, tiny_trainer


def _fit(tmp_path: Path, shm: Path, replicas: int | None) -> ExactResume:
    lightning.seed_everything(0, verbose=False)
    exact = ExactResume(memory_tier=MemoryTierOptions(dir=str(shm), every_n_train_steps_max=1, replicas=replicas))
    trainer = tiny_trainer([exact, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=0)], max_steps=3)
    trainer.fit(TinyModel(), datamodule=TinyData())
    return exact


def test_a_replica_on_a_single_node_is_refused_naming_the_option(tmp_path: Path, shm: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"memory_tier.replicas=1 needs at least 2 nodes.*num_nodes=1"):
        _fit(tmp_path, shm, replicas=1)


def test_one_node_replicates_nothing_by_default(tmp_path: Path, shm: Path) -> None:
    exact = _fit(tmp_path, shm, replicas=None)
    assert exact.memory is not None and exact.memory.replicas == 0
    assert exact.memory.replicator is None and exact.memory.ring.group is None
