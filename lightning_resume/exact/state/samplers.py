"""A ``RandomSampler`` that draws exactly what torch's draws and whose position resumes mid-epoch.

torch's ``RandomSampler`` (torch/utils/data/sampler.py, ``RandomSampler.__iter__``) is a generator function:
at an epoch's first index it takes a fresh seed from the global torch RNG (``generator=None``) or uses its
own generator, then yields ``randperm`` blocks (``randint`` chunks of 32 with ``replacement``). Nothing of it
is saved, so a resumed epoch draws another order. ``ResumableRandomSampler`` is the same class with an
iterator that makes the same draws at the same moments and remembers the epoch's seed (or its generator's
state at the epoch's start) and how many indices it has yielded; torchdata's loader iterators save that
state (``Stateful``) and a resumed iterator regenerates the epoch's order and skips what was yielded, without
loading a sample. Order and generator use are torch's bit for bit, in every epoch.

``PlannedDistributedSampler`` is the other mechanism here: a distributed sampler made, in place, to yield
the rest of one epoch as an elastic resume dealt it (``EpochPlan``), then its own order again. Mechanism
only: nothing here knows loaders or Lightning.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from torch.utils.data import RandomSampler
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

SEED = "seed"
GENERATOR = "generator_state"
YIELDED = "yielded"


def _order(sampler: RandomSampler, generator: torch.Generator) -> Iterator[int]:
    """The indices torch's ``RandomSampler.__iter__`` yields once its generator is chosen (same code, same
    chunks, so the generator advances exactly as torch's does)."""
    n = len(sampler.data_source)
    if sampler.replacement:
        for _ in range(sampler.num_samples // 32):
            yield from torch.randint(high=n, size=(32,), dtype=torch.int64, generator=generator).tolist()
        yield from torch.randint(
            high=n, size=(sampler.num_samples % 32,), dtype=torch.int64, generator=generator
        ).tolist()
    else:
        for _ in range(sampler.num_samples // n):
            yield from torch.randperm(n, generator=generator).tolist()
        yield from torch.randperm(n, generator=generator).tolist()[: sampler.num_samples % n]


class _EpochOrder(Iterator[int]):
    """One epoch of a ``ResumableRandomSampler``: chooses its generator at the first index, as torch does."""

    def __init__(self, sampler: RandomSampler) -> None:
        self._sampler = sampler
        self._indices: Optional[Iterator[int]] = None
        self._seed: Optional[int] = None
        self._generator_state: Optional[torch.Tensor] = None
        self._yielded = 0

    def __iter__(self) -> _EpochOrder:
        return self

    def __next__(self) -> int:
        if self._indices is None:
            self._indices = self._start()
        index = next(self._indices)
        self._yielded += 1
        return index

    def _start(self, skip: int = 0) -> Iterator[int]:
        own = self._sampler.generator
        if own is None:
            if self._seed is None:  # torch's draw, at the moment torch makes it
                self._seed = int(torch.empty((), dtype=torch.int64).random_().item())
            generator = torch.Generator()
            generator.manual_seed(self._seed)
        else:
            if self._generator_state is None:
                self._generator_state = own.get_state()
            else:  # resuming: the user's generator back where this epoch started, then advanced as it was
                own.set_state(self._generator_state)
            generator = own
        indices = _order(self._sampler, generator)
        for _ in itertools.islice(indices, skip):
            pass
        return indices

    def state_dict(self) -> dict[str, Any]:
        return {SEED: self._seed, GENERATOR: self._generator_state, YIELDED: self._yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._seed, self._generator_state, self._yielded = state[SEED], state[GENERATOR], int(state[YIELDED])
        if self._seed is not None or self._generator_state is not None:
            self._indices = self._start(skip=self._yielded)  # else the epoch had not started: it starts as torch's


class ResumableRandomSampler(RandomSampler):
    """torch's ``RandomSampler`` (same arguments, same order, same RNG use) with a resumable position.

    ``ExactResume`` turns the ``RandomSampler`` of a plain ``DataLoader`` into one in place (same object, same
    attributes), so user code that holds the sampler keeps it. Used directly, it takes torch's arguments.
    """

    def __iter__(self) -> Iterator[int]:
        return _EpochOrder(self)


def make_resumable(sampler: RandomSampler) -> ResumableRandomSampler:
    """``sampler`` itself, its class changed to ``ResumableRandomSampler`` (only for an exact ``RandomSampler``:
    a subclass has an order of its own). Undo with :func:`make_plain`."""
    if type(sampler) is not RandomSampler:
        raise TypeError(f"expected a torch RandomSampler, got {type(sampler).__name__}")
    sampler.__class__ = ResumableRandomSampler
    return sampler  # type: ignore[return-value]  # the same object, now of the subclass


def make_plain(sampler: RandomSampler) -> None:
    """Undo :func:`make_resumable`."""
    sampler.__class__ = RandomSampler


@dataclass(frozen=True)
class EpochPlan:
    """The indices one rank trains in the rest of epoch ``epoch`` after an elastic resume, which began
    ``start_batch`` batches into the epoch (the batches the saving ranks had trained)."""

    epoch: int
    indices: list[int]
    start_batch: int

    def to_state(self) -> dict[str, Any]:
        """As a checkpoint holds it (tensors and ints: no pickle needed)."""
        return {
            "epoch": self.epoch,
            "indices": torch.tensor(self.indices, dtype=torch.int64),
            "start": self.start_batch,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> EpochPlan:
        indices = state["indices"]
        values = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
        return cls(int(state["epoch"]), [int(i) for i in values], int(state["start"]))


class PlannedDistributedSampler(StatefulDistributedSampler):
    """A ``StatefulDistributedSampler`` that yields its ``plan`` in the plan's epoch and its ordinary order
    in every other. The position (``yielded``, torchdata's state) counts indices of whichever it yields, so
    a resume inside the planned epoch, on the same world size, continues the plan exactly."""

    plan: EpochPlan
    next_yielded: Optional[int]

    def __iter__(self) -> Iterator[int]:
        if self.plan.epoch != self.epoch:
            return super().__iter__()
        return self._planned()

    def _planned(self) -> Iterator[int]:
        # torchdata's order of events (sampler.py:198-206): the loaded position is taken at the first index.
        self.yielded = self.next_yielded or 0
        self.next_yielded = None
        for index in self.plan.indices[self.yielded :]:
            self.yielded += 1
            yield index


def install_plan(sampler: StatefulDistributedSampler, plan: EpochPlan) -> Callable[[], None]:
    """Make ``sampler`` (itself, in place) yield ``plan`` in its epoch; return what puts its class back."""
    original = type(sampler)
    if original is not PlannedDistributedSampler:
        sampler.__class__ = PlannedDistributedSampler
    assert isinstance(sampler, PlannedDistributedSampler)
    sampler.plan = plan

    def back() -> None:
        sampler.__dict__.pop("plan", None)
        sampler.__class__ = original

    return back


def installed_plan(sampler: Any) -> Optional[EpochPlan]:
    """The plan ``sampler`` yields in its current epoch, or ``None``."""
    if isinstance(sampler, PlannedDistributedSampler) and sampler.plan.epoch == sampler.epoch:
        return sampler.plan
    return None
