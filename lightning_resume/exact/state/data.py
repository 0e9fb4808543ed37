"""The data position: which training batches were consumed, and the RNG of loader worker processes.

``ResumableDataset`` makes each worker process's RNG streams part of torchdata's loader state: the
worker calls its ``state_dict()`` after every batch it produces (torchdata's snapshot), so the
state of the worker that made the last consumed batch is exactly the state to restore.
``loader_problems`` names the loader configurations that cannot resume exactly, and their fix.
Mechanisms and checks over loader objects only; nothing here knows Lightning's loops.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from torch.utils.data import Dataset, IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.stateful import Stateful

from lightning_resume._compat.torchdata import distributed_samples_yielded, with_position
from lightning_resume.exact.state.rng import capture_rng, restore_rng


class _WorkerRngState:
    """Shared by the map-style and iterable wrappers: worker RNG plus the wrapped dataset's own state."""

    dataset: Any

    def state_dict(self) -> dict[str, Any]:
        # In the main process (num_workers=0) the main RNG streams are ExactResume's to capture.
        in_worker = get_worker_info() is not None
        inner = self.dataset.state_dict() if isinstance(self.dataset, Stateful) else None
        return {"worker_rng": capture_rng() if in_worker else None, "dataset": inner}

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
    own business: its iterator must be ``Stateful`` (torchdata saves and restores it)."""

    def __init__(self, dataset: IterableDataset) -> None:
        self.dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        return iter(self.dataset)


def _sampler_of(loader: StatefulDataLoader) -> Any:
    batch_sampler = getattr(loader, "batch_sampler", None)
    return getattr(batch_sampler, "sampler", None) or getattr(loader, "sampler", None)


def loader_problems(name: str, loader: Any) -> list[str]:
    """Why ``loader`` cannot resume exactly, each with its fix; empty when it can."""
    if not isinstance(loader, StatefulDataLoader):
        return [
            f"{name} is a {type(loader).__name__}, whose position cannot be saved: a resume would restart"
            " the epoch. Use torchdata.stateful_dataloader.StatefulDataLoader (same arguments)."
        ]
    problems = []
    sampler = _sampler_of(loader)
    if type(sampler).__name__ in {"DistributedSamplerWrapper", "_DistributedSamplerWrapper"}:
        problems.append(
            f"{name}: Lightning wrapped its sampler in a DistributedSamplerWrapper, which has no state, so the"
            " sample order changes after a resume. Pass sampler=torchdata.stateful_dataloader.sampler."
            "StatefulDistributedSampler(...) and Trainer(use_distributed_sampler=False)."
        )
    generator = getattr(loader, "generator", None)
    if generator is not None and getattr(sampler, "generator", None) is generator:
        problems.append(
            f"{name}: the sampler and the loader share one torch.Generator, so the next epoch's order after a"
            " resume differs. Give the sampler its own generator (or none) and keep the loader's separate."
        )
    dataset = loader.dataset
    if loader.num_workers > 0 and not isinstance(dataset, (_WorkerRngState, Stateful)):
        problems.append(
            f"{name}: num_workers={loader.num_workers} and the dataset is not wrapped, so worker RNG streams"
            " (augmentation) are not saved. Wrap it: StatefulDataLoader(lightning_resume.ResumableDataset(ds), ...)"
            " -- or ignore this if the dataset draws no random numbers."
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
