"""The data position: which training batches were consumed, and the RNG of loader worker processes.

``ResumableDataset`` makes each worker process's RNG streams part of torchdata's loader state: the
worker calls its ``state_dict()`` after every batch it produces (torchdata's snapshot), so the
state of the worker that made the last consumed batch is exactly the state to restore.

``adopt`` gives the loaders a user already has the same property without a change to their code, and
keeps the user's objects: a plain ``DataLoader`` becomes a ``StatefulDataLoader`` *in place* (its class is
changed to ``ResumableDataLoader`` for the duration of the fit and put back by ``AdoptedLoaders.release``),
torch's ``BatchSampler``, ``RandomSampler`` and ``DistributedSampler`` become their resumable counterparts in
place (``samplers.ResumableRandomSampler`` draws exactly torch's order), and workers see the dataset wrapped
for its RNG while ``loader.dataset`` stays the user's. The trade-off, chosen over a rebuilt loader: users keep
``trainer.train_dataloader is loader``, their sampler (its ``set_epoch`` is called, a ``batch_sampler=`` keeps
working) and every attribute they set; what they can tell is ``type()`` (a subclass of their class) during
``fit``, and a ``state_dict`` attribute that is ``None`` (Lightning must not save the position as its own).
Anything else (not a ``DataLoader``, a subclass, a custom batch sampler without state) is left exactly as it
is and ``unsaved_position`` names it. ``loader_problems`` names what still cannot resume exactly, and the fix.
Mechanisms and checks over loader objects only; nothing here knows Lightning's loops.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import torch.utils.data as tud
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader import sampler as stateful_samplers
from torchdata.stateful_dataloader.stateful import Stateful
from typing_extensions import override

from lightning_resume._compat import lightning as lc
from lightning_resume._compat import torchdata as td
from lightning_resume.exact.state.rng import capture_rng, restore_rng
from lightning_resume.exact.state.samplers import installed_plan, make_plain, make_resumable


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


class WorkerRngLoader(td.WorkerDatasetLoader):
    """A ``StatefulDataLoader`` whose workers see the dataset wrapped (``ResumableDataset``), so their RNG
    streams are part of each worker's state; ``loader.dataset`` stays the user's dataset."""

    user_class: type[DataLoader] = StatefulDataLoader
    """The class the user made the loader as (``loader_signature`` records it)."""

    @override
    def worker_dataset(self) -> Any:
        dataset = self.dataset
        if self.num_workers == 0 or isinstance(dataset, _WorkerRngState):
            return dataset
        return ResumableIterableDataset(dataset) if isinstance(dataset, IterableDataset) else ResumableDataset(dataset)


class ResumableDataLoader(WorkerRngLoader):
    """A user's plain ``DataLoader``, made a ``StatefulDataLoader`` in place for the duration of a fit.

    Its position is ExactResume's to save (``loader_state``), aligned with the last trained batch. Lightning
    saves and loads the state of every loader it sees as stateful in its loop state (combined_loader.py:378-392,
    fit_loop.py:523-529), which a plain ``DataLoader`` is not: so this one must not look stateful to it, and a
    checkpoint holds what it holds without the callback. A protocol member set to ``None`` is absent for
    ``isinstance`` checks against ``typing.Protocol``s (Lightning's ``_Stateful``, torchdata's ``Stateful``).
    """

    user_class = DataLoader
    state_dict = None
    load_state_dict = None


Undo = Callable[[], None]


def loader_state(loader: Any) -> Optional[dict[str, Any]]:
    """The position of ``loader`` to save, or ``None`` when it has none."""
    if isinstance(loader, ResumableDataLoader):
        return StatefulDataLoader.state_dict(loader)
    return loader.state_dict() if isinstance(loader, Stateful) else None


def load_loader_state(loader: Any, state: dict[str, Any]) -> bool:
    """Apply a position saved by :func:`loader_state`; ``False`` when ``loader`` cannot take one."""
    if isinstance(loader, ResumableDataLoader):
        StatefulDataLoader.load_state_dict(loader, state)
    elif isinstance(loader, Stateful):
        loader.load_state_dict(state)
    else:
        return False
    return True


def _adopt_sampler(sampler: Any) -> list[Undo]:  # Any: the class test below is what decides
    """The samplers torch and Lightning make, given a position in place (same object, same order)."""
    if type(sampler) is tud.RandomSampler:
        make_resumable(sampler)
        return [lambda: make_plain(sampler)]
    if type(sampler) is DistributedSampler:  # Lightning's, for DDP (seed + epoch): it needs only a position
        td.stateful_distributed_sampler(sampler)
        return [lambda: td.plain_distributed_sampler(sampler)]
    return []  # sequential, stateful or unknown: torchdata counts the indices and skips as many on resume


def _adopt_batch_sampler(loader: DataLoader) -> Optional[list[Undo]]:
    """The loader's index samplers made resumable in place; ``None`` for a custom batch sampler without state
    (it holds its own order)."""
    if isinstance(loader.dataset, IterableDataset):
        return []  # an infinite constant sampler: the position is the dataset's or its iterator's
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:  # batch_size=None: the sampler yields the indices itself
        return _adopt_sampler(loader.sampler)
    undo: list[Undo] = []
    if type(batch_sampler) is tud.BatchSampler:
        td.stateful_batch_sampler(batch_sampler)
        undo.append(lambda: td.plain_batch_sampler(batch_sampler))
    if isinstance(batch_sampler, stateful_samplers.BatchSampler):
        inner = batch_sampler.sampler
        return undo + (
            _replace_wrapper(loader, batch_sampler) if _replaceable_wrapper(inner) else _adopt_sampler(inner)
        )
    if isinstance(batch_sampler, Stateful):  # a batch sampler with a position of its own
        return _adopt_sampler(getattr(batch_sampler, "sampler", None))
    return None


def _replaceable_wrapper(sampler: Any) -> bool:
    inner = lc.sampler_inside_distributed_wrapper(sampler)
    plain = (tud.RandomSampler, tud.SequentialSampler, stateful_samplers.RandomSampler)
    return inner is not None and type(inner) in plain and not getattr(inner, "replacement", False)


def _replace_wrapper(loader: DataLoader, batch_sampler: Any) -> list[Undo]:
    """Lightning wraps a sampler it does not recognise (torchdata's ``RandomSampler`` among them) in a
    ``DistributedSamplerWrapper``, whose order is re-drawn from the inner sampler each epoch and has no
    position; a plain random or sequential inner order is replaced by ``StatefulDistributedSampler``'s seeded
    shuffle (a different but equally uniform order, disjoint across ranks). The wrapper is Lightning's
    object, not the user's; it is put back at the end of the fit."""
    wrapper = batch_sampler.sampler
    if len(lc.sampler_inside_distributed_wrapper(wrapper)) != len(loader.dataset):  # type: ignore[arg-type]
        return []
    new = stateful_samplers.StatefulDistributedSampler(
        loader.dataset, wrapper.num_replicas, wrapper.rank, wrapper.shuffle, wrapper.seed, wrapper.drop_last
    )

    def put(sampler: Any) -> None:
        batch_sampler.sampler = sampler
        loader.__dict__["sampler"] = sampler  # DataLoader refuses to set it after __init__

    put(new)
    return [lambda: put(wrapper)]


def adopt(loader: Any) -> list[Undo]:
    """Make ``loader`` itself resume exactly (see the module docstring); return what puts it back.

    A plain ``DataLoader`` becomes a ``ResumableDataLoader`` and a ``StatefulDataLoader`` a
    ``WorkerRngLoader``, in place, with their torch samplers made resumable in place. Anything else (a
    subclass, a custom batch sampler without state, not a loader at all) is left as it is:
    ``unsaved_position`` names it.
    """
    if type(loader) is DataLoader:
        cls: type[StatefulDataLoader] = ResumableDataLoader
    elif type(loader) is StatefulDataLoader:
        cls = WorkerRngLoader
    else:
        return []
    undo = _adopt_batch_sampler(loader)
    if undo is None:
        if type(loader) is DataLoader:
            return []
        undo = []
    original = type(loader)
    if original is DataLoader:
        td.become_stateful(loader, cls)
        return [*undo, lambda: td.become_plain(loader, original)]
    loader.__class__ = cls

    def back() -> None:
        loader.__class__ = original

    return [*undo, back]


class AdoptedLoaders:
    """The training loaders :func:`adopt` changed in one fit, put back by :meth:`release` at its end."""

    def __init__(self) -> None:
        self._undo: list[Undo] = []

    def __call__(self, loader: Any) -> Any:
        """The loader Lightning iterates: ``loader`` itself, made resumable where it can be."""
        self._undo += adopt(loader)
        return loader

    def release(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def is_resumable(loader: Any) -> bool:
    """Whether ``loader``'s position is saved."""
    return isinstance(loader, (ResumableDataLoader, Stateful))


def unsaved_position(name: str, loader: Any) -> Optional[str]:
    """What a resume does with a loader whose position cannot be saved, or ``None`` when it can."""
    if is_resumable(loader):
        return None
    if not isinstance(loader, DataLoader):
        kind = f"a {type(loader).__name__}, not a DataLoader"
    elif type(loader) is DataLoader:
        kind = f"a DataLoader with a {type(loader.batch_sampler).__name__} batch sampler, which has no state"
    else:
        kind = f"a {type(loader).__name__} (a DataLoader subclass, left as it is)"
    return (
        f"{name} is {kind}, so its position is not saved: after a resume its epoch goes on at the saved batch"
        " count with a fresh iterator, as without ExactResume. Use a torch DataLoader or torchdata's"
        " StatefulDataLoader (same arguments), or give the batch sampler state_dict/load_state_dict."
    )


def _sampler_of(loader: DataLoader) -> Any:
    batch_sampler = getattr(loader, "batch_sampler", None)
    return getattr(batch_sampler, "sampler", None) or getattr(loader, "sampler", None)


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
    wraps = isinstance(loader, WorkerRngLoader)
    if loader.num_workers > 0 and not wraps and not isinstance(dataset, (_WorkerRngState, Stateful)):
        wrapper = "ResumableIterableDataset" if isinstance(dataset, IterableDataset) else "ResumableDataset"
        problems.append(
            f"{name}: num_workers={loader.num_workers}, a {type(loader).__name__} and an unwrapped dataset, so worker"
            f" RNG streams (augmentation) are not saved. Wrap it: StatefulDataLoader(lightning_resume.{wrapper}(ds),"
            " ...) -- or ignore this if the dataset draws no random numbers."
        )
    return problems


def batching(loader: Any) -> tuple[Optional[int], bool]:
    """The per-rank batch size and ``drop_last`` this loader batches with (size ``None``: no fixed size).

    The loader's own, or its batch sampler's when it has none: Lightning rebuilds a ``StatefulDataLoader``
    around its distributed sampler with ``batch_sampler=`` (torchdata's ``BatchSampler`` is not torch's class,
    so Lightning keeps it as a custom one), which leaves ``loader.batch_size`` ``None`` and ``loader.drop_last``
    ``False``; the batch sampler holds the loader's ``batch_size`` and ``drop_last``."""
    size = getattr(loader, "batch_size", None)
    if size is not None:
        return int(size), bool(getattr(loader, "drop_last", False))
    batch_sampler = getattr(loader, "batch_sampler", None)
    size = getattr(batch_sampler, "batch_size", None)
    return (int(size) if isinstance(size, int) else None), bool(getattr(batch_sampler, "drop_last", False))


def loader_signature(loader: Any) -> dict[str, Any]:
    """What must be equal between the saving and the resuming run for a position to mean the same."""
    dataset: Any = getattr(loader, "dataset", None)  # anything, sized or not: len() raising TypeError is handled
    size, drop_last = batching(loader)
    try:
        length: Optional[int] = len(dataset)
    except TypeError:
        length = None
    return {
        "type": getattr(loader, "user_class", type(loader)).__name__,
        "num_workers": getattr(loader, "num_workers", None),
        # the batch sampler's where Lightning rebuilt the loader around one (``batching``)
        "batch_size": size,
        "drop_last": drop_last if size is not None else getattr(loader, "drop_last", None),
        "dataset_length": length,
    }


def distributed_sampler(loader: Any) -> Optional[stateful_samplers.StatefulDistributedSampler]:
    """The loader's distributed sampler (Lightning's and torch's are made torchdata's in place by ``adopt``),
    or ``None``: only its order can be rebuilt for another world size."""
    sampler = _sampler_of(loader) if isinstance(loader, DataLoader) else None
    return sampler if isinstance(sampler, stateful_samplers.StatefulDistributedSampler) else None


def order_record(loader: Any) -> dict[str, Any]:
    """What an elastic resume needs to rebuild this rank's order of the current epoch: the distributed
    sampler's arguments, its epoch and the plan it yields (``sampler`` names any other kind)."""
    sampler = distributed_sampler(loader)
    if sampler is None:
        inner = _sampler_of(loader) if isinstance(loader, DataLoader) else None
        kind = "an IterableDataset" if isinstance(getattr(loader, "dataset", None), IterableDataset) else None
        return {"sampler": kind or type(inner if inner is not None else loader).__name__}
    plan = installed_plan(sampler)
    return {
        "sampler": type(sampler).__name__,
        "length": len(sampler.dataset),
        "shuffle": bool(sampler.shuffle),
        "seed": int(sampler.seed),
        "drop_last": bool(sampler.drop_last),
        "num_replicas": int(sampler.num_replicas),
        "rank": int(sampler.rank),
        "epoch": int(sampler.epoch),
        "plan": None if plan is None else plan.to_state(),
    }
