"""DDP's gradient bucket layout, saved and given to a resumed process's reducer (``exact.state.ddp_buckets``).

On a real one-rank gloo DDP (an in-process store, no network): the layout a checkpoint records is the one DDP
rebuilt after its first backward (a pending rebuild done at the save); a fresh reducer given that layout reduces
in it from its first backward; and a resume on more than two ranks that cannot have it says why. The
kill-and-resume proof on 3 and 4 ranks is ``tests/integration/test_exact_ddp_ranks.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_resume.exact.state import ddp_buckets


@pytest.fixture
def group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _ddp(**kwargs: Any) -> DistributedDataParallel:
    torch.manual_seed(0)
    return DistributedDataParallel(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)), **kwargs)


def _trainer(ddp: DistributedDataParallel, world_size: int = 3) -> Any:
    return SimpleNamespace(strategy=SimpleNamespace(model=ddp), world_size=world_size)


def _step(ddp: DistributedDataParallel) -> None:
    ddp(torch.randn(4, 8)).sum().backward()


def _layout_reduced(ddp: DistributedDataParallel) -> list[list[int]]:
    """The layout the reducer's buckets have now, as parameter indices (from a comm hook's view of them)."""
    index = {id(p): i for i, p in enumerate(ddp.module.parameters())}
    seen: list[list[int]] = []

    def hook(state, bucket):  # type: ignore[no-untyped-def]  (DDP reads the annotations; postponed, they are strings)
        seen.append([index[id(p)] for p in bucket.parameters()])
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, hook)
    _step(ddp)
    return seen


def test_a_save_records_the_layout_ddp_rebuilt_from_the_gradients_order(group: None) -> None:
    ddp = _ddp()
    assert ddp_buckets.capture(_trainer(ddp)) is None  # no backward yet: the first layout, in a new process too
    _step(ddp)  # the first backward records the order; the next forward would rebuild: the save does it
    assert ddp_buckets.capture(_trainer(ddp)) == [[3, 2, 1, 0]]


@pytest.mark.parametrize(
    "kwargs", [{}, {"static_graph": True}, {"gradient_as_bucket_view": True}], ids=["default", "static", "views"]
)
def test_a_resumed_reducer_reduces_in_the_saved_layout_from_its_first_backward(group: None, kwargs: dict) -> None:
    fresh = _ddp(**kwargs)
    assert ddp_buckets.restore(_trainer(fresh), {ddp_buckets.KEY: [[3, 2], [1, 0]]}) == []
    assert ddp_buckets.capture(_trainer(fresh)) == [[3, 2], [1, 0]]  # a save before the first step keeps it
    assert _layout_reduced(fresh) == [[3, 2], [1, 0]]
    assert _layout_reduced(_ddp()) == [[0, 1, 2, 3]]  # without it: DDP's first-iteration layout


def test_two_ranks_keep_ddps_layout(group: None) -> None:
    ddp = _ddp()
    assert ddp_buckets.restore(_trainer(ddp, world_size=2), {}) == []  # a + b == b + a: nothing to lay out
    assert _layout_reduced(ddp) == [[0, 1, 2, 3]]


def test_a_run_that_never_rebuilt_its_buckets_resumes_with_ddps_own(group: None) -> None:
    ddp = _ddp()
    assert ddp_buckets.restore(_trainer(ddp), {ddp_buckets.KEY: None}) == []
    assert _layout_reduced(ddp) == [[0, 1, 2, 3]]


@pytest.mark.parametrize(
    ("saved", "cause"),
    [
        ({}, "this checkpoint does not record that layout"),
        ({ddp_buckets.KEY: [[3, 2, 1]]}, "does not hold each of this model's 4 parameters once"),
    ],
    ids=["checkpoint_without_layout", "layout_of_another_model"],
)
def test_a_layout_that_cannot_be_had_is_named_with_the_cause(group: None, saved: dict, cause: str) -> None:
    ddp = _ddp()
    (line,) = ddp_buckets.restore(_trainer(ddp), saved)
    assert "all-reduce over 3 ranks may differ in the last bits" in line and cause in line
    assert _layout_reduced(ddp) == [[0, 1, 2, 3]]


def test_a_comm_hook_registered_before_the_resume_still_reduces(group: None) -> None:
    ddp, calls = _ddp(), []

    def hook(state, bucket):  # type: ignore[no-untyped-def]
        calls.append(len(bucket.parameters()))
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, hook)  # as Lightning's DDPStrategy(ddp_comm_hook=...) registers it
    assert ddp_buckets.restore(_trainer(ddp), {ddp_buckets.KEY: [[3, 2], [1, 0]]}) == []
    _step(ddp)
    assert calls == [2, 2]
