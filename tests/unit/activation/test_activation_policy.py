"""The pure block-selection policy: each mode, its estimates, and its errors."""

from __future__ import annotations

import dataclasses
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


# --------------------------------------------------------------------------- selective recomputation


def costed(saved: list[int], sel_bytes: list[int], full_s: list[float], sel_s: list[float]) -> list[BlockRecord]:
    """``stack`` with made-up measurements: kept bytes and recompute seconds per mode."""
    records = stack(len(saved), saved=saved)
    out = []
    for r in records:
        if r.class_paths[0] == BLOCK:
            i = int(r.name.split(".")[1])
            r = dataclasses.replace(
                r, forward_seconds=full_s[i], selective_bytes=sel_bytes[i], selective_seconds=sel_s[i]
            )
        out.append(r)
    return out


def brute_force(saved, sel_bytes, full_s, sel_s, total, budget):
    """The least recompute over all 3^n choices that fits, or None."""
    best = None
    for combo in itertools.product(("none", "selective", "full"), repeat=len(saved)):
        freed = sum(
            {"none": 0, "full": s, "selective": s - k}[c] for c, s, k in zip(combo, saved, sel_bytes, strict=True)
        )
        cost = sum({"none": 0.0, "full": f, "selective": q}[c] for c, f, q in zip(combo, full_s, sel_s, strict=True))
        if total - freed <= budget and (best is None or cost < best):
            best = cost
    return best


@settings(max_examples=120, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 60), st.integers(0, 80), st.integers(1, 50), st.integers(0, 50)),
        min_size=1,
        max_size=6,
    ),
    st.integers(0, 300),
    st.integers(0, 30),
)
def test_budget_with_selective_picks_the_cheapest_feasible_combination(blocks, budget, outside):
    saved = [b[0] for b in blocks]
    sel_bytes = [b[1] for b in blocks]  # may exceed saved: selective can keep more than plain autograd
    full_s = [float(b[2]) for b in blocks]
    sel_s = [float(b[3]) for b in blocks]
    total = sum(saved) + outside
    selection = BlockSelection(classes=(BLOCK,), mode="budget", budget_bytes=budget, recompute="selective")
    records = costed(saved, sel_bytes, full_s, sel_s)
    best = brute_force(saved, sel_bytes, full_s, sel_s, total, budget)
    if best is None:
        with pytest.raises(ConfigurationError, match="cannot be met"):
            plan_checkpointing(records, selection, total)
        return
    plan = plan_checkpointing(records, selection, total)
    assert sum(r.recompute_seconds or 0.0 for r in plan.rows) == pytest.approx(best)
    assert plan.bytes_after is not None and plan.bytes_after <= budget
    assert [r.name for r in plan.rows] == [f"layers.{i}" for i in range(len(saved))]
    chosen = {r.name: r.recompute for r in plan.rows}
    assert {u[0] for u in plan.units} == {n for n, c in chosen.items() if c == "full"}
    assert {u[0] for u in plan.selective} == {n for n, c in chosen.items() if c == "selective"}


def test_budget_mixes_modes_when_that_is_cheapest():
    # Block 0: selective frees 80 of 100 for 1 s (full: 10 s). Block 1: selective frees little.
    records = costed([100, 100], [20, 90], [10.0, 10.0], [1.0, 1.0])
    selection = BlockSelection(classes=(BLOCK,), mode="budget", budget_bytes=50, recompute="selective")
    plan = plan_checkpointing(records, selection, total_bytes=220)  # needs 170 freed
    assert [(r.name, r.recompute) for r in plan.rows] == [("layers.0", "selective"), ("layers.1", "full")]
    assert plan.units == (("layers.1",),) and plan.selective == (("layers.0",),)
    assert plan.bytes_after == 220 - 80 - 100
    assert plan.blocks == ("layers.0", "layers.1")
    text = plan.describe()
    assert "1 recomputed selectively" in text and "(selective)" in text
    assert "layers.0  selective" in text and "1000.00" in text  # the table: block, mode, kept, recompute ms


def test_budget_with_selective_error_names_the_least_that_can_be_kept():
    records = costed([100, 100], [20, 90], [10.0, 10.0], [1.0, 1.0])
    selection = BlockSelection(classes=(BLOCK,), mode="budget", budget_bytes=5, recompute="selective")
    with pytest.raises(ConfigurationError, match="cannot be met.*still keeps about 20 bytes.*>= 20"):
        plan_checkpointing(records, selection, total_bytes=220)


def test_budget_with_selective_needs_times():
    selection = BlockSelection(classes=(BLOCK,), mode="budget", budget_bytes=5, recompute="selective")
    with pytest.raises(ConfigurationError, match="forward times and selective bytes"):
        plan_checkpointing(stack(2), selection, total_bytes=220)


def test_selective_all_and_sqrt_make_selective_units():
    plan = plan_checkpointing(stack(4), BlockSelection(classes=(BLOCK,), recompute="selective"))
    assert plan.units == () and plan.selective == tuple((f"layers.{i}",) for i in range(4))
    assert plan.save_ops and "aten.mm" in plan.save_ops
    seg = plan_checkpointing(stack(4), BlockSelection(classes=(BLOCK,), mode="sqrt", recompute="selective"))
    assert [len(u) for u in seg.selective] == [2, 2] and seg.units == ()


def test_selective_options_are_validated():
    with pytest.raises(ConfigurationError) as info:
        BlockSelection(classes=(BLOCK,), recompute="some", save_ops=("mm",))
    assert any("recompute='some'" in p for p in info.value.problems)
    assert any("save_ops=['mm']" in p for p in info.value.problems)
    with pytest.raises(ConfigurationError, match=r"save_ops=\[\] keeps nothing"):
        BlockSelection(classes=(BLOCK,), recompute="selective", save_ops=())
