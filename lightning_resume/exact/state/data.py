"""The data position: which training batches were consumed, and the RNG of loader worker processes.

``ResumableDataset`` makes each worker process's RNG streams part of torchdata's loader state: the
worker calls its ``state_dict()`` after every batch it produces (torchdata's snapshot), so the
state of the worker that made the last consumed batch is exactly the state to restore.
``resumable_loader`` gives the pipeline a user already has the same property without a change to
their code: a plain ``DataLoader`` becomes a ``StatefulDataLoader`` with the same arguments, samplers
without state become their stateful equivalents (same order), and with ``num_workers > 0`` the
dataset is wrapped. ``loader_problems`` names what still cannot resume exactly, and the fix.
Mechanisms and checks over loader objects only; nothing here knows Lightning's loops.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch.utils.data as tud
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader import sampler as stateful_samplers
from torchdata.stateful_dataloader.stateful import Stateful

from lightning_resume._compat import lightning as lc
from lightning_resume._compat.torchdata import distributed_samples_yielded, with_position
from lightning_resume.exact.state.rng import capture_rng, restore_rng


class _WorkerRngState:
    """Shared by the map-style and iterable wrappers: worker RNG plus the wrapped dataset's own state."""

    dataset: Any

    def state_dict(self) -> Optional[dict[str, Any]]:
        # In the main process (num_workers=0) the main RNG streams are ExactResume's to capture.
        in_worker = get_worker_info() is not None
        inner = self.dataset.state_dict() if isinstance(self.dataset, Stateful) else None
        return {"worker_rng": capture_rng() if in_worker else None, "dataset": inner}

    def __getattr__(self, name: str) -> Any:
        # The user's code keeps reaching its dataset's attributes through ``loader.dataset``.
        if name == "dataset" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("worker_rng") is not None and get_worker_info() is not None:
            restore_rng(state["worker_rng"])
        if state.get("dataset") is not None and isinstance(self.dataset, Stateful):
            self.dataset.load_state_dict(state["dataset"])


class ResumableDataset(_WorkerRngState, Dataset):
    """Wrap a map-style dataset so that loader worker RNG streams resume exactly.

    Needed only when the dataset draws random numbers (augmentation) and ``num_workers > 0``:
    ``StatefulDataLoader(ResumableDataset(ds), num_workers=2, ...)``. Indexing, ``len`` and the
    dataset's own ``state_dict`` (if any) pass through unchanged.
    """

    def __init__(self, dataset: Dataset) -> None:
        if isinstance(dataset, IterableDataset):
            raise TypeError("ResumableDataset wraps map-style datasets; use ResumableIterableDataset for iterables")
        self.dataset = dataset

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)


class ResumableIterableDataset(_WorkerRngState, IterableDataset):
    """The iterable counterpart of ``ResumableDataset``. The position in the stream is the dataset's
    own business: its iterator (or itself) is ``Stateful`` and torchdata saves and restores it. When
    neither is, there is no state to save: torchdata then replays the epoch's first batches from
    freshly seeded workers, which draws the same worker random numbers again."""

    def __init__(self, dataset: IterableDataset) -> None:
        self.dataset = dataset
        self._iterator: Any = None

    def __iter__(self) -> Iterator[Any]:
        self._iterator = iter(self.dataset)
        return self._iterator

    def __len__(self) -> int:
        return len(self.dataset)  # TypeError, as for the dataset, when it has no length

    def state_dict(self) -> Optional[dict[str, Any]]:
        if not isinstance(self.dataset, Stateful) and not isinstance(self._iterator, Stateful):
            return None  # torchdata fast-forwards only when no worker state exists (stateful_dataloader.py:1064)
        return super().state_dict()


def _stateful_sampler(sampler: Any, dataset: Any) -> Any:
    """A sampler with the same order as ``sampler`` whose position torchdata saves, or ``sampler`` itself.

    torch's ``RandomSampler`` draws its order from the global RNG when the epoch's iterator is made;
    torchdata's keeps a generator in its state. A ``DistributedSampler`` (Lightning's, for DDP) has no
    position and no epoch in a state; ``StatefulDistributedSampler`` is the same order with a position.
    Lightning wraps samplers it does not recognise (torchdata's ``RandomSampler`` among them) in a
    ``DistributedSamplerWrapper``, whose order is re-drawn from the inner sampler each epoch; an inner
    plain random or sequential order is replaced by ``StatefulDistributedSampler``'s seeded shuffle
    (a different but equally uniform order, and disjoint across ranks).
    """
    inner = lc.sampler_inside_distributed_wrapper(sampler)
    plain = (tud.RandomSampler, tud.SequentialSampler, stateful_samplers.RandomSampler)
    if inner is not None and type(inner) in plain and len(inner) == len(dataset) and not _replacing(inner):
        return stateful_samplers.StatefulDistributedSampler(
            dataset, sampler.num_replicas, sampler.rank, sampler.shuffle, sampler.seed, sampler.drop_last
        )
    if type(sampler) is DistributedSampler:
        return stateful_samplers.StatefulDistributedSampler(
            dataset, sampler.num_replicas, sampler.rank, sampler.shuffle, sampler.seed, sampler.drop_last
        )
    if type(sampler) is tud.RandomSampler:
        return stateful_samplers.RandomSampler(
            sampler.data_source, sampler.replacement, sampler.num_samples, sampler.generator
        )
    return sampler


def _replacing(sampler: Any) -> bool:
    return bool(getattr(sampler, "replacement", False))


def _needs_worker_rng(loader: Any) -> bool:
    return loader.num_workers > 0 and not isinstance(loader.dataset, _WorkerRngState)


def resumable_loader(loader: Any) -> Any:
    """``loader`` made again so that its position and worker RNG resume exactly, or ``loader`` itself when
    it already does or cannot be made again (``loader_problems`` then says what will differ).

    Only a plain ``DataLoader`` or a ``StatefulDataLoader`` (or subclass) with no batch sampler of its own
    is made again, with the same arguments (a ``DataLoader`` subclass may behave differently as a
    ``StatefulDataLoader``, and a custom batch sampler holds its own order).
    """
    if type(loader) is not DataLoader and not isinstance(loader, StatefulDataLoader):
        return loader
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is not None and not isinstance(batch_sampler, tud.BatchSampler):
        return loader
    sampler = _sampler_of(loader)
    if batch_sampler is not None:
        sampler = _stateful_sampler(sampler, loader.dataset)
    dataset: Any = loader.dataset
    if _needs_worker_rng(loader):
        is_iterable = isinstance(dataset, IterableDataset)
        dataset = ResumableIterableDataset(dataset) if is_iterable else ResumableDataset(dataset)
    if isinstance(loader, StatefulDataLoader) and dataset is loader.dataset and sampler is _sampler_of(loader):
        return loader
    cls = StatefulDataLoader if type(loader) is DataLoader else type(loader)
    remade = lc.reinstantiate_loader(loader, cls, sampler, dataset)
    return loader if remade is None else remade


def _sampler_of(loader: StatefulDataLoader) -> Any:
    batch_sampler = getattr(loader, "batch_sampler", None)
    return getattr(batch_sampler, "sampler", None) or getattr(loader, "sampler", None)


def unsaved_position(name: str, loader: Any) -> Optional[str]:
    """What a resume does with a loader whose position cannot be saved, or ``None`` when it can."""
    if isinstance(loader, StatefulDataLoader) or not isinstance(loader, DataLoader):
        return None
    return (
        f"{name} is a {type(loader).__name__} that could not be made a StatefulDataLoader (a DataLoader subclass,"
        " a custom batch sampler, or arguments Lightning cannot recover), so its position is not saved: after a"
        " resume the epoch goes on at the saved batch count with a fresh iterator (a new order from the start of"
        " the data), repeating some samples and skipping others. Use torchdata.stateful_dataloader."
        "StatefulDataLoader (same arguments)."
    )


def loader_problems(name: str, loader: Any) -> list[str]:
    """Why ``loader`` cannot resume exactly, each with its fix; empty when it can (``unsaved_position`` aside)."""
    if not isinstance(loader, StatefulDataLoader):
        return []
    problems = []
    sampler = _sampler_of(loader)
    if lc.sampler_inside_distributed_wrapper(sampler) is not None:
        problems.append(
            f"{name}: Lightning wrapped its sampler ({type(lc.sampler_inside_distributed_wrapper(sampler)).__name__})"
            " in a DistributedSamplerWrapper, which has no state, so the sample order changes after a resume."
            " Pass sampler=torchdata.stateful_dataloader.sampler.StatefulDistributedSampler(...) and"
            " Trainer(use_distributed_sampler=False)."
        )
    generator = getattr(loader, "generator", None)
    if generator is not None and getattr(sampler, "generator", None) is generator:
        problems.append(
            f"{name}: the sampler and the loader share one torch.Generator, so the next epoch's order after a"
            " resume differs. Give the sampler its own generator (or none) and keep the loader's separate."
        )
    dataset = loader.dataset
    if loader.num_workers > 0 and not isinstance(dataset, (_WorkerRngState, Stateful)):
        wrapper = "ResumableIterableDataset" if isinstance(dataset, IterableDataset) else "ResumableDataset"
        problems.append(
            f"{name}: num_workers={loader.num_workers}, a custom batch sampler and an unwrapped dataset, so worker"
            f" RNG streams (augmentation) are not saved. Wrap it: StatefulDataLoader(lightning_resume.{wrapper}(ds),"
            " ...) -- or ignore this if the dataset draws no random numbers."
        )
    return problems


def loader_signature(loader: Any) -> dict[str, Any]:
    """What must be equal between the saving and the resuming run for a position to mean the same."""
    dataset: Any = getattr(loader, "dataset", None)  # anything, sized or not: len() raising TypeError is handled
    try:
        length: Optional[int] = len(dataset)
    except TypeError:
        length = None
    return {
        "type": type(loader).__name__,
        "num_workers": getattr(loader, "num_workers", None),
        "batch_size": getattr(loader, "batch_size", None),
        "drop_last": getattr(loader, "drop_last", None),
        "dataset_length": length,
    }


def remap_position(
    state: dict[str, Any], old_world: int, new_world: int, batch_size: int
) -> tuple[dict[str, Any], str]:
    """A single-process ``StatefulDataLoader`` + ``StatefulDistributedSampler`` position, moved to another
    world size so that the samples of the epoch consumed by all old ranks are exactly the ones the new
    ranks skip (a distributed sampler deals the same permutation out round-robin, so the first
    ``old_world * yielded`` indices are the consumed ones whatever the world size).

    Returns the new state and a line saying what is not exact. Raises ``ValueError`` for a state it
    does not recognise (worker snapshots, no sampler counter).
    """
    consumed = distributed_samples_yielded(state) * old_world
    per_rank, leftover = divmod(consumed, new_world)
    batches = per_rank // batch_size
    per_rank = batches * batch_size  # a batch boundary: the next batch starts cleanly
    repeated = consumed - per_rank * new_world
    new = with_position(state, batches, per_rank)
    note = (
        f"data position remapped from {old_world} to {new_world} ranks: {consumed} samples of this epoch were"
        f" trained; the new ranks skip {per_rank * new_world}"
        + (f", so {repeated} samples are trained again" if repeated else " (none repeated or skipped)")
    )
    return new, note
