"""A rank's local shards through one file of our format and back (``sharded.local``), in two gloo processes on CPU
(``tests/helpers/jobs/local_shards_job.py``): what the memory tier keeps of a sharded run, one file per rank.

- FSDP2 (``fully_shard``) with an uneven shard (3 rows on 2 ranks: rank 1 holds one row of the first layer and
  an empty shard of the last) and tensor parallel (``ColwiseParallel``/``RowwiseParallel``): ``to_local``, the
  file, ``check`` (nothing to say) and ``fill`` into a model of other weights restore every weight and AdamW
  moment bit for bit, gathered whole.
- ``check`` names each path that does not fit: a snapshot of the FSDP model against the tensor-parallel one
  (another mesh, same world size and shapes), a float64 model, a snapshot missing a key."""

from __future__ import annotations

import json

import pytest

from tests.helpers import processes
from tests.helpers.paths import job_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("local-shards")
    processes.run([job_script("local_shards_job.py"), str(out)], timeout=240, env={"PYTHONWARNINGS": "ignore"})
    return [json.loads((out / f"result-{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("case", ["fsdp", "fsdp4", "tp"], ids=["fsdp-uneven", "fsdp", "tensor-parallel"])
def test_local_shards_restore_bitwise_through_a_file(results: list[dict], case: str) -> None:
    for rank, result in enumerate(results):
        assert result[case]["problems"] == [], (rank, result[case]["problems"])
        assert result[case]["bitwise"], f"rank {rank}: the restored state differs from the trained one ({case})"
    if case != "tp":  # rank 1's shard of the last layer (1 row over 2 ranks) is empty, and goes through too
        assert "state_dict/2.weight" in results[1][case]["empty"] and not results[0][case]["empty"]


def test_check_names_each_path_that_does_not_fit(results: list[dict]) -> None:
    mismatch = results[0]["mismatch"]
    first = mismatch["mesh"][0]
    assert (
        first.startswith("state_dict/0.weight: ")
        and "mesh_dims ['data_parallel'] saved, ['tensor_parallel'] now" in first
    )
    assert any("placements ['S(0)'] saved, ['S(1)'] now" in line for line in mismatch["mesh"])
    assert len(mismatch["mesh"]) == 12, mismatch["mesh"]  # 4 weights, 8 moments: every one on another mesh
    assert "state_dict/0.weight: dtype float32 saved, float64 now" in mismatch["dtype"]
    assert mismatch["missing"] == ["state_dict/2.bias: not in the snapshot"]


def test_a_refused_snapshot_leaves_an_optimizer_without_state_as_it_was() -> None:
    """Checking a snapshot builds the state's layout, for which torch initializes an optimizer that has no state yet
    (a zero-lr step: AdamW's ``step`` becomes 1). When the snapshot is refused, a fresh start follows: it must start
    from no state, as it would have without the memory tier."""
    import lightning.pytorch as pl
    import torch

    from lightning_resume.io.sharded_strategy import ShardedModelParallelStrategy

    module = pl.LightningModule()
    module.layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    strategy = ShardedModelParallelStrategy.__new__(ShardedModelParallelStrategy)  # set up by hand: no process group
    strategy._model, strategy._lightning_module, strategy._optimizers = module, module, [optimizer]
    problems = strategy.check_local({"state_dict": {}, "optimizer_states": []})
    assert problems and "not a snapshot of local shards" in problems[0], problems
    assert not optimizer.state, optimizer.state
