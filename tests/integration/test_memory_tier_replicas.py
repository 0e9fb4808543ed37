"""The replicated memory tier across real "nodes" (``tests/helpers/nodes.py``: one ``torchrun --nnodes 2
--node-rank i`` per node on 127.0.0.1, each node its own tmpfs): a node lost between durable saves."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.helpers import kill_resume as h
from tests.helpers import nodes

DURABLE_EVERY, MEMORY_EVERY, KILL_AT = 6, 2, 9
"""Durable snapshots every 6 steps, memory ones every 2: killed at step 9, disk has step 6, memory step 8."""


@pytest.fixture
def machines(tmp_path: Path) -> Iterator[nodes.Cluster]:
    with nodes.cluster(tmp_path / "machines") as cluster:
        yield cluster


def _cfg(tmp_path: Path, devices: int, **memory: Any) -> dict[str, Any]:
    memory = {"every_n_train_steps_max": MEMORY_EVERY, **memory}
    exact = {"schedule": {"every_n_train_steps_max": DURABLE_EVERY}, "memory_tier": memory}
    return {
        "n": 80 * devices, "batch_size": 4, "max_epochs": 2, "dropout": 0.2, "augment": True, "shuffle": True,
        "num_nodes": 2, "devices": devices, "safetensors": True, "ckpt": {"save_top_k": 0}, "exact_args": exact,
        "ckpt_dir": str(tmp_path / "B" / "ckpt"), "flush_memory_tier": True,
    }  # fmt: skip


def test_a_node_lost_without_replicas_resumes_from_disk_exactly(tmp_path: Path, machines: nodes.Cluster) -> None:
    cfg = _cfg(tmp_path, devices=1, replicas=0)
    a = dict(cfg, out=str(tmp_path / "A"), ckpt_dir=str(tmp_path / "A" / "ckpt"))
    nodes.run(a, machines, tmp_path)
    b = dict(cfg, out=str(tmp_path / "B"), pause_before=KILL_AT)
    nodes.run_until_paused(b, machines, tmp_path).lose(1)
    c = dict(cfg, out=str(tmp_path / "C"), resume="last")
    nodes.run(c, machines, tmp_path)
    h.assert_exact_resume(Path(a["out"]), Path(c["out"]), resumed_after=DURABLE_EVERY, ranks=2)
