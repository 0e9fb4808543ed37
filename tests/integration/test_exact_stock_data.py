"""Exact resume with the data pipelines users already have, no change to their code (issue 12).

Each case: run A uninterrupted, run B SIGKILLed from outside, run C a fresh process with
``fit(ckpt_path="last")``; C's per-step samples and loss bits and its final state equal A's, and no
warning says the resume will not be exact. The pipelines are the stock ones: ``StatefulDataLoader(ds,
shuffle=..., num_workers=...)`` with augmentation inside the Dataset and no wrapper, datasets with their
own ``state_dict()``, iterables with and without state, a plain ``torch.utils.data.DataLoader``, and
DDP with Lightning's own sampler replacement (``use_distributed_sampler=True``). The controls check that
the same kill and resume without ``ExactResume`` differs, so the comparisons can fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import kill_resume as h

# Outside `make test` (see tests/integration/conftest.py). The subset keeps: a dataset with its own state,
# an iterable without state, a plain DataLoader in epoch 1 (all with 2 workers), DDP with a plain
# DataLoader and Lightning's sampler replacement, and one control.
EXTENDED = frozenset(
    {
        "test_stock_pipeline_resumes_bit_for_bit[map_workers2]",
        "test_stock_pipeline_resumes_bit_for_bit[map_workers2_second_epoch]",
        "test_stock_pipeline_resumes_bit_for_bit[map_own_state_workers0]",
        "test_stock_pipeline_resumes_bit_for_bit[iterable_stateful_iterator_workers2]",
        "test_stock_pipeline_resumes_bit_for_bit[iterable_own_state_workers2]",
        "test_stock_pipeline_resumes_bit_for_bit[torch_dataloader]",
        "test_stock_pipeline_resumes_bit_for_bit[torch_dataloader_iterable_workers2]",
        "test_ddp_with_lightnings_sampler_resumes_bit_for_bit[shuffle_seeded_workers0]",
        "test_ddp_with_lightnings_sampler_resumes_bit_for_bit[no_shuffle_drop_last_unseeded_workers2]",
        "test_ddp_with_lightnings_sampler_resumes_bit_for_bit[shuffle_drop_last_unseeded]",
        "test_ddp_with_lightnings_sampler_resumes_bit_for_bit[recipe_sampler_workers2_second_epoch]",
        "test_ddp_with_lightnings_sampler_resumes_bit_for_bit[torch_dataloader_rank_local_batchnorm_epoch_end]",
        "test_control_without_exact_resume_differs[map_workers2]",
        "test_control_without_exact_resume_differs[map_own_state_workers2]",
        "test_ddp_control_without_exact_resume_differs",
    }
)

EVERY_3 = {"every_n_train_steps": 3, "save_top_k": -1, "save_last": True, "filename": "{step}"}
STOCK = {
    "pipeline": "stock", "n": 40, "batch_size": 4, "max_epochs": 2, "dropout": 0.2, "augment": True,
    "shuffle": True, "ckpt": EVERY_3,
}  # fmt: skip
NOT_EXACT = "resume will not be exact"

# name: (config overrides, pause before micro-batch k, micro-batches trained before the checkpoint)
SINGLE = {
    "map_workers2": ({"num_workers": 2}, 7, 6),
    "map_workers2_second_epoch": ({"num_workers": 2}, 13, 12),
    "map_own_state_workers2": ({"dataset": "stateful", "num_workers": 2}, 7, 6),
    "map_own_state_workers0": ({"dataset": "stateful"}, 7, 6),
    "iterable_stateful_iterator_workers2": ({"dataset": "stream", "num_workers": 2}, 7, 6),
    "iterable_own_state_workers2": ({"dataset": "stateful_stream", "num_workers": 2}, 7, 6),
    "iterable_no_state_workers2": ({"dataset": "plain_stream", "num_workers": 2}, 7, 6),
    "torch_dataloader": ({"pipeline": "torch"}, 7, 6),
    "torch_dataloader_workers2_second_epoch": ({"pipeline": "torch", "num_workers": 2}, 13, 12),
    "torch_dataloader_iterable_workers2": ({"pipeline": "torch", "dataset": "stream", "num_workers": 2}, 7, 6),
}

DDP = {"devices": 2, "use_distributed_sampler": True}
BATCHNORM_EPOCH_END = {
    "pipeline": "torch",
    "shuffle": False,
    "n": 32,
    "max_epochs": 3,
    "batchnorm": True,
    "accumulate": 2,
    "ddp": {"broadcast_buffers": False},
    "val_check_interval": 1.0,
    "record_validation": True,
    "ckpt": {"every_n_epochs": 1, "save_top_k": -1, "save_last": True},
}
"""BatchNorm statistics each rank keeps (no broadcast_buffers), so rank 1's validation uses its own (only rank 0's
are in Lightning's checkpoint); a plain loader without shuffle, gradient accumulation, the checkpoint at the epoch's
end after validation (a num_workers=0 StatefulDistributedSampler), resumed in epoch 2. Records: 8 micro-batches and
2 validation batches after each of 2 epochs."""
DDP_CASES = {
    "shuffle_seeded_workers0": ({}, 7, 6),
    "no_shuffle_drop_last_unseeded_workers2": (
        {"shuffle": False, "drop_last": True, "n": 42, "seed_everything": False, "num_workers": 2},
        7,
        6,
    ),
    "shuffle_drop_last_unseeded": ({"drop_last": True, "n": 42, "seed_everything": False}, 7, 6),
    "torch_dataloader_shuffle_workers2": ({"pipeline": "torch", "num_workers": 2}, 7, 6),
    "torch_dataloader_rank_local_batchnorm_epoch_end": (BATCHNORM_EPOCH_END, 8, 12),
    # The same in the verified format: the saves hash no weights; rank 1's restored state is compared with the
    # loaded checkpoint, its own BatchNorm statistics (put back on purpose) left out.
    "torch_dataloader_rank_local_batchnorm_epoch_end_safetensors": (
        {**BATCHNORM_EPOCH_END, "safetensors": True},
        8,
        12,
    ),
    # The README recipe (own StatefulDistributedSampler): workers make the iterator before Lightning sets the epoch.
    "recipe_sampler_workers2_second_epoch": (
        {"pipeline": "recipe", "use_distributed_sampler": False, "num_workers": 2},
        7,
        6,
    ),
}


def _warnings(cfg: dict) -> str:
    return h.output(cfg, tail=None)


@pytest.mark.parametrize("case", list(SINGLE))
def test_stock_pipeline_resumes_bit_for_bit(tmp_path: Path, case: str) -> None:
    overrides, pause, resumed_after = SINGLE[case]
    a, c = h.three_runs({**STOCK, **overrides}, tmp_path, pause)
    h.assert_exact_resume(a["out"], c["out"], resumed_after)
    assert NOT_EXACT not in _warnings(a) + _warnings(c)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DDP_CASES))
def test_ddp_with_lightnings_sampler_resumes_bit_for_bit(tmp_path: Path, case: str) -> None:
    overrides, pause, resumed_after = DDP_CASES[case]
    a, c = h.three_runs({**STOCK, **DDP, **overrides}, tmp_path, pause)
    h.assert_exact_resume(a["out"], c["out"], resumed_after, ranks=2)
    assert NOT_EXACT not in _warnings(a) + _warnings(c)
    # Lightning's sampler deals each rank its own shard: within an epoch the ranks train disjoint samples.
    h.assert_ranks_disjoint(a["out"], epoch=0)


@pytest.mark.parametrize(
    "overrides",
    [{"num_workers": 2}, {"dataset": "stateful", "num_workers": 2}, {"pipeline": "torch"}],
    ids=["map_workers2", "map_own_state_workers2", "torch_dataloader"],
)
def test_control_without_exact_resume_differs(tmp_path: Path, overrides: dict) -> None:
    a, c = h.three_runs({**STOCK, **overrides, "exact": False}, tmp_path, 7)
    with pytest.raises(AssertionError, match="differs"):
        h.assert_exact_resume(a["out"], c["out"], 6)


@pytest.mark.slow
def test_ddp_control_without_exact_resume_differs(tmp_path: Path) -> None:
    a, c = h.three_runs({**STOCK, **DDP, "exact": False, "augment": False, "dropout": 0.0}, tmp_path, 7)
    with pytest.raises(AssertionError, match="differs"):
        h.assert_exact_resume(a["out"], c["out"], 6, ranks=2)
