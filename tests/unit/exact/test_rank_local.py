"""Per-rank buffers (``exact.state.rank_local``) and the epoch-end position of a ``StatefulDistributedSampler``
(``_compat``): the parts of a DDP resume that Lightning's rank-0 checkpoint leaves out or leaves pending."""

from __future__ import annotations

import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from lightning_resume._compat import lightning as lc
from lightning_resume.exact.state import rank_local


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


def test_persistent_buffers_leave_out_parameters_and_unsaved_buffers() -> None:
    net = _net()
    net.register_buffer("cache", torch.zeros(2), persistent=False)
    assert set(rank_local.persistent_buffers(net)) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}


def test_without_a_process_group_nothing_differs_from_rank_zero() -> None:
    assert rank_local.differing_from_rank_zero(_net()) == {}


def test_put_back_copies_the_saved_values_into_the_module_buffers() -> None:
    net = _net()
    saved = {"1.running_mean": torch.arange(4.0)}
    buffer = net.get_buffer("1.running_mean")
    assert rank_local.put_back(net, saved) == []
    assert net.get_buffer("1.running_mean") is buffer  # in place: optimizers and hooks keep their references
    assert torch.equal(buffer, torch.arange(4.0))


def test_put_back_names_what_it_cannot_apply_and_changes_nothing_for_it() -> None:
    net = _net()
    before = net.get_buffer("1.running_var").clone()
    problems = rank_local.put_back(net, {"1.running_var": torch.ones(5), "2.running_mean": torch.ones(4)})
    assert problems == [
        "rank-local buffer '1.running_var': checkpoint (5,) torch.float32, now (4,) torch.float32",
        "rank-local buffer '2.running_mean': the module has no such persistent buffer now",
    ]
    assert torch.equal(net.get_buffer("1.running_var"), before)


def test_an_epoch_end_position_does_not_empty_the_next_epoch() -> None:
    """torchdata's sampler takes a loaded position at its first index; an iterator made and dropped at an
    epoch's end with num_workers=0 leaves it pending, and the next epoch would skip all its samples."""
    data = list(range(8))
    loader = StatefulDataLoader(data, batch_size=2, sampler=StatefulDistributedSampler(data, 2, 0, shuffle=False))
    iterator = iter(loader)
    first = [next(iterator) for _ in range(2)]  # the whole epoch on this rank, its end not yet seen (as Lightning's)
    state = loader.state_dict()
    loader.load_state_dict(state)
    lc.apply_loader_states([loader])
    loader.sampler.set_epoch(1)
    assert [b.tolist() for b in loader] == [b.tolist() for b in first]  # the next epoch, whole
