"""The pure block-selection policy: each mode, its estimates, and its errors."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_resume.activation.policy import (
    BlockRecord,
    BlockSelection,
    parse_bytes,
    plan_checkpointing,
    select_candidates,
    split_evenly,
)
from lightning_resume.errors import ConfigurationError

BLOCK = "pkg.Block"


def stack(n: int, sequential: bool = True, saved: list[int] | None = None, inputs: int = 10) -> list[BlockRecord]:
    """Root, ``layers`` container, n blocks each with an inner ``fc`` (so outermost matching matters)."""
    saved = saved if saved is not None else [100] * n
    records = [
        BlockRecord("", ("pkg.Model",), params=n * 11 + 1),
        BlockRecord("layers", ("torch.nn.Sequential" if sequential else "torch.nn.ModuleList",), "", False, 0, n * 11),
    ]
    for i in range(n):
        records.append(
            BlockRecord(f"layers.{i}", (BLOCK, "torch.nn.Module"), "layers", sequential, i, 11, saved[i], inputs)
        )
        records.append(BlockRecord(f"layers.{i}.fc", ("torch.nn.Linear",), f"layers.{i}", False, 0, 10, 0, 0))
    return records


def test_all_mode_picks_every_matching_block_by_class():
    plan = plan_checkpointing(stack(3), BlockSelection(classes=(BLOCK,)))
    assert plan.units == (("layers.0",), ("layers.1",), ("layers.2",))
    assert plan.extra_forward == pytest.approx(33 / 34)


def test_glob_keeps_only_outermost_matches():
    plan = plan_checkpointing(stack(3), BlockSelection(pattern="layers.*"))
    assert plan.blocks == ("layers.0", "layers.1", "layers.2")


def test_class_and_glob_combine_as_and():
    plan = plan_checkpointing(stack(4), BlockSelection(classes=(BLOCK,), pattern="layers.[23]"))
    assert plan.blocks == ("layers.2", "layers.3")


def test_subclass_matches_through_its_class_paths():
    plan = plan_checkpointing(stack(2), BlockSelection(classes=("torch.nn.Linear",)))
    assert plan.blocks == ("layers.0.fc", "layers.1.fc")


def test_every_k_takes_blocks_0_k_2k():
    plan = plan_checkpointing(stack(7), BlockSelection(classes=(BLOCK,), mode="every", every=3))
    assert plan.blocks == ("layers.0", "layers.3", "layers.6")


def test_sqrt_segments_of_16_blocks_are_4_runs_of_4():
    plan = plan_checkpointing(stack(16), BlockSelection(classes=(BLOCK,), mode="sqrt"), total_bytes=16 * 110 + 5)
    assert [len(u) for u in plan.units] == [4, 4, 4, 4]
    assert plan.units[1] == tuple(f"layers.{i}" for i in range(4, 8))
    # kept: everything but the segments' internals and their non-head inputs (3 per segment)
    assert plan.bytes_after == 16 * 110 + 5 - 16 * 100 - 4 * 3 * 10
    assert plan.peak_recompute_bytes == 4 * 100 + 3 * 10


def test_sqrt_refuses_blocks_outside_a_sequential():
    with pytest.raises(ConfigurationError, match="nn.Sequential"):
        plan_checkpointing(stack(4, sequential=False), BlockSelection(classes=(BLOCK,), mode="sqrt"))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 200))
def test_sqrt_segment_count_and_balance(n):
    plan = plan_checkpointing(stack(n), BlockSelection(classes=(BLOCK,), mode="sqrt"))
    lengths = [len(u) for u in plan.units]
    assert len(lengths) == math.ceil(math.sqrt(n))
    assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)
    assert plan.blocks == tuple(f"layers.{i}" for i in range(n))  # contiguous, ordered, complete


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=7), st.integers(0, 400), st.integers(0, 30))
def test_budget_picks_the_fewest_blocks_that_fit(saved, budget, outside):
    records = stack(len(saved), saved=saved)
    total = sum(saved) + outside
    selection = BlockSelection(classes=(BLOCK,), mode="budget", budget_bytes=budget)
    feasible = [
        k for k in range(len(saved) + 1) if any(total - sum(c) <= budget for c in itertools.combinations(saved, k))
    ]
    if not feasible:
        with pytest.raises(ConfigurationError, match="cannot be met"):
            plan_checkpointing(records, selection, total)
        return
    plan = plan_checkpointing(records, selection, total)
    assert len(plan.units) == feasible[0]
    assert plan.bytes_after is not None and plan.bytes_after <= budget
    assert list(plan.blocks) == sorted(plan.blocks, key=lambda n: int(n.split(".")[1]))  # model order


def test_budget_without_measurements_is_refused():
    records = [r.__class__(**{**r.__dict__, "saved_bytes": None}) for r in stack(2)]
    with pytest.raises(ConfigurationError, match="measured"):
        plan_checkpointing(records, BlockSelection(classes=(BLOCK,), mode="budget", budget_bytes=1), 10)


def test_pattern_matching_nothing_names_what_exists():
    with pytest.raises(ConfigurationError, match=r"no module matches pattern='model\.blocks\.\*'.*layers\.0"):
        plan_checkpointing(stack(2), BlockSelection(pattern="model.blocks.*"))


def test_bad_arguments_are_all_reported_at_once():
    with pytest.raises(ConfigurationError) as info:
        BlockSelection(mode="budget", every=2)
    problems = info.value.problems
    assert len(problems) == 3
    assert any("no blocks chosen" in p for p in problems)
    assert any("every=2" in p for p in problems)
    assert any("budget=<bytes" in p for p in problems)


@pytest.mark.parametrize(
    "kwargs", [{"mode": "every"}, {"mode": "every", "every": 0}, {"mode": "nope"}, {"budget_bytes": 5}]
)
def test_each_bad_argument_is_refused(kwargs):
    with pytest.raises(ConfigurationError):
        BlockSelection(classes=(BLOCK,), **kwargs)


def test_describe_lists_units_bytes_and_cost():
    plan = plan_checkpointing(stack(4), BlockSelection(classes=(BLOCK,), mode="sqrt"), total_bytes=500)
    text = plan.describe()
    assert "2 unit(s) over 4 of 4" in text and "layers.0 .. layers.1 (2 blocks)" in text
    assert "500 B ->" in text and "of one forward pass" in text


def test_split_evenly_and_parse_bytes():
    assert [len(p) for p in split_evenly(list(range(8)), 3)] == [3, 3, 2]
    assert parse_bytes("512MiB", "budget") == 512 << 20
    assert parse_bytes("1.5 GB", "budget") == 1_500_000_000
    assert parse_bytes(123, "budget") == 123
    with pytest.raises(ConfigurationError, match="budget='lots'"):
        parse_bytes("lots", "budget")


def test_candidates_exclude_the_root():
    assert all(r.name for r in select_candidates(stack(2), BlockSelection(pattern="*")))
