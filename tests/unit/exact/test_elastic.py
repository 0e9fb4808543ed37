"""The elastic resume's policy (which samples each new rank trains) and its sampler mechanism, in one process."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from lightning_resume._compat import torchdata as td
from lightning_resume.exact.state import elastic
from lightning_resume.exact.state.samplers import EpochPlan, PlannedDistributedSampler, install_plan, installed_plan

SPEC = elastic.OrderSpec(length=50, shuffle=True, seed=3, drop_last=False)


def _orders(world: int, trained: list[int], epoch: int = 1) -> list[elastic.RankOrder]:
    return [elastic.RankOrder(SPEC.indices(world, r, epoch), trained[r]) for r in range(world)]


def test_the_rank_orders_are_torchs_distributed_sampler():
    ds = list(range(50))
    for rank in range(3):
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=3, rank=rank, shuffle=True, seed=3)
        sampler.set_epoch(4)
        assert SPEC.indices(3, rank, 4) == list(sampler)


@pytest.mark.parametrize(("old", "new"), [(2, 1), (1, 2), (2, 3), (3, 2), (4, 3), (2, 2)])
@pytest.mark.parametrize("trained_batches", [0, 1, 5])
def test_every_sample_of_the_epoch_is_trained_once_but_the_stated_padding(old, new, trained_batches):
    orders = _orders(old, [trained_batches * 4] * old)
    rest = elastic.untrained(orders)
    dealt = elastic.deal(rest, new, drop_last=False)
    before = [i for o in orders for i in o.indices[: o.trained]]
    after = [i for part in dealt.per_rank for i in part]
    old_padding = Counter(before) - Counter(set(before))  # the old sampler's own (once the epoch is all trained)
    assert Counter(before + after) == Counter(range(50)) + Counter(dealt.padded) + old_padding
    assert len({len(part) for part in dealt.per_rank}) == 1  # every rank as many samples: DDP steps together
    assert len(dealt.padded) == -len(rest) % new and dealt.untrained == len(rest)


def test_the_old_samplers_padding_is_not_trained_again():
    """50 samples on 3 ranks: the sampler pads to 51 by repeating one; a trained sample is never dealt again."""
    orders = _orders(3, [17, 17, 17])  # the whole epoch, padding included
    assert elastic.untrained(orders) == []
    orders = _orders(3, [16, 16, 16])
    rest = elastic.untrained(orders)
    trained = {i for o in orders for i in o.indices[:16]}
    assert len(rest) == len(set(rest)) == 50 - len(trained) and not set(rest) & trained


def test_the_rest_keeps_the_epochs_order():
    """Merged by (position, rank): the order in which one sampler dealt the epoch."""
    orders = [elastic.RankOrder([0, 2, 4, 6], 1), elastic.RankOrder([1, 3, 5, 7], 2)]
    assert elastic.untrained(orders) == [2, 4, 5, 6, 7]
    assert elastic.deal([2, 4, 5, 6, 7], 2, drop_last=False).per_rank == [[2, 5, 7], [4, 6, 2]]


def test_drop_last_leaves_out_the_remainder():
    dealt = elastic.deal(list(range(7)), 3, drop_last=True)
    assert dealt.per_rank == [[0, 3], [1, 4], [2, 5]] and dealt.dropped == [6] and not dealt.padded


def test_a_tiny_rest_is_padded_by_cycling():
    assert elastic.deal([9], 3, drop_last=False).per_rank == [[9], [9], [9]]
    assert elastic.deal([], 3, drop_last=False).per_rank == [[], [], []]


def test_keep_global_batch_needs_an_even_share():
    assert elastic.accumulation(2, 1, 1) == 2
    assert elastic.accumulation(4, 3, 6) == 2
    with pytest.raises(ValueError, match=r"2 ranks x accumulate_grad_batches=1 = 2 batches .* 3 ranks"):
        elastic.accumulation(2, 1, 3)


def test_derived_seeds_differ_per_rank_and_repeat_per_move():
    rng = {"torch": torch.Generator().manual_seed(5).get_state()}
    seeds = [elastic.derived_seed(rng, 2, 4, r) for r in (2, 3)]
    assert seeds[0] != seeds[1] and seeds == [elastic.derived_seed(rng, 2, 4, r) for r in (2, 3)]
    assert elastic.derived_seed(rng, 2, 3, 2) != seeds[0]  # another move, another stream


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_planned_sampler_yields_its_plan_then_its_own_order_and_resumes_inside_it(num_workers):
    ds = list(range(40))
    sampler = StatefulDistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=7)
    sampler.set_epoch(1)
    plan = EpochPlan(1, [5, 9, 13, 2, 30, 31, 8], start_batch=3)
    back = install_plan(sampler, plan)
    assert installed_plan(sampler) == plan and isinstance(sampler, PlannedDistributedSampler)
    loader = StatefulDataLoader(ds, sampler=sampler, batch_size=2, num_workers=num_workers)
    it = iter(loader)
    first = [next(it).tolist() for _ in range(2)]
    assert first == [[5, 9], [13, 2]]
    state = loader.state_dict()
    assert td.batches_yielded(state) == 2
    resumed = StatefulDataLoader(ds, sampler=sampler, batch_size=2, num_workers=num_workers)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == [[30, 31], [8]]  # the rest of the plan, nothing else
    sampler.set_epoch(2)
    ordinary = StatefulDistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=7)
    ordinary.set_epoch(2)
    assert installed_plan(sampler) is None and list(sampler) == list(ordinary)
    back()
    assert type(sampler) is StatefulDistributedSampler and not hasattr(sampler, "plan")


def test_a_plan_round_trips_through_a_checkpoint_state():
    plan = EpochPlan(3, list(range(10, 0, -1)), 7)
    state = plan.to_state()
    assert isinstance(state["indices"], torch.Tensor) and EpochPlan.from_state(state) == plan


def test_batches_yielded_counts_the_steps_since_the_last_snapshot():
    ds = list(range(40))
    loader = StatefulDataLoader(ds, batch_size=4, num_workers=2, snapshot_every_n_steps=3)
    it = iter(loader)
    for _ in itertools.repeat(None, 5):
        next(it)
    assert td.batches_yielded(loader.state_dict()) == 5
