"""Every use of torchdata's private ``StatefulDataLoader`` layout, in one place (torchdata 0.11).

``StatefulDataLoader.state_dict()`` is a dict whose keys are private constants of torchdata's iterator
and sampler classes. ``ExactResume`` reads them to describe a position (``inspect``) and to count the
batches a position holds (an elastic resume deals out the rest of the epoch again). The keys are imported from the classes that define
them, so a rename fails here at import, not silently in a remapped position. ``become_stateful`` and
its siblings give an existing torch loader, batch sampler or distributed sampler the attributes torchdata's
constructors add, so that the user's own object becomes its torchdata counterpart in place.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch.utils.data as tud
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import BatchSampler, StatefulDistributedSampler
from torchdata.stateful_dataloader.stateful_dataloader import (
    _ITERATOR_FINISHED,
    _StatefulMultiProcessingDataLoaderIter,
    _StatefulSingleProcessDataLoaderIter,
)
from typing_extensions import override

_NUM_YIELDED = _StatefulSingleProcessDataLoaderIter._NUM_YIELDED  # stateful_dataloader.py:465
_SNAPSHOT = _StatefulMultiProcessingDataLoaderIter._SNAPSHOT  # :893
_WORKER_SNAPSHOTS = _StatefulMultiProcessingDataLoaderIter._WORKER_SNAPSHOTS  # :895
_SNAPSHOT_STEP = _StatefulMultiProcessingDataLoaderIter._SNAPSHOT_STEP  # :896
_STEPS_SINCE_SNAPSHOT = _StatefulMultiProcessingDataLoaderIter._STEPS_SINCE_SNAPSHOT  # :897


def describe_position(state: Any) -> str:
    """How far a saved loader state is into its epoch, in words."""
    if not isinstance(state, Mapping):
        return "none (not a StatefulDataLoader)"
    snapshot = state.get(_SNAPSHOT) or {}
    workers = len(snapshot.get(_WORKER_SNAPSHOTS) or {})
    if _SNAPSHOT_STEP in snapshot:  # multiprocess loader: batches yielded = the snapshot's step
        return f"{snapshot[_SNAPSHOT_STEP]} batches yielded, {workers} worker states"
    return f"{state.get(_NUM_YIELDED)} batches yielded"


def drop_finished_sampler_position(loader: Any) -> None:
    """Forget a position a ``StatefulDistributedSampler`` of ``loader`` still holds after a whole epoch was
    applied. Its ``__iter__`` is a generator (sampler.py:198-206): ``load_state_dict`` only sets
    ``next_yielded``, which the generator takes at its first index. An iterator made and dropped without a
    batch (a ``num_workers=0`` loader prefetches nothing) leaves it set, and the next epoch would skip that
    many samples: all of them, at an epoch's end."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    for sampler in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if isinstance(sampler, StatefulDistributedSampler):
            sampler.next_yielded = None


def iterator_finished(state: Any) -> bool:
    """Whether a saved ``StatefulDataLoader`` position is of an iterator that had run out (it raised
    ``StopIteration``; stateful_dataloader.py:90, :518, :1197): its loader's next ``iter`` starts a new epoch."""
    return isinstance(state, Mapping) and bool(state.get(_ITERATOR_FINISHED))


def hold_finished_position(loader: Any) -> None:
    """Apply a pending finished position (:func:`iterator_finished`) the way the saving run held it: as the
    loader's finished iterator, so that its next ``iter`` makes one new iterator for the next epoch, from the
    restored sampler state (stateful_dataloader.py:381-412). Left pending, that ``iter`` would make two, the first
    only to load the position: one more draw from the global RNG, mid-training."""
    if isinstance(loader, StatefulDataLoader) and loader.next_iter_state is not None:
        loader._iterator = loader._get_iterator()  # consumes next_iter_state (:384-388)
        loader._initial_iter_for_state_dict = False


def batches_yielded(state: Mapping[str, Any]) -> int:
    """Batches a ``StatefulDataLoader`` had handed out in its epoch when ``state`` was taken: the iterator's
    count (single process, stateful_dataloader.py:465), or its last snapshot's step plus the steps since
    (multiprocess, :893-896: the snapshot holds the main process's sampler position of that step)."""
    if _SNAPSHOT in state:
        return int(state[_SNAPSHOT][_SNAPSHOT_STEP]) + int(state.get(_STEPS_SINCE_SNAPSHOT) or 0)
    return int(state.get(_NUM_YIELDED) or 0)


class WorkerDatasetLoader(StatefulDataLoader):
    """A ``StatefulDataLoader`` whose iterators (and so its workers) get ``worker_dataset()`` while
    ``loader.dataset`` stays what the user passed. An iterator reads ``loader.dataset`` once, in its
    constructor (torch dataloader.py, ``_BaseDataLoaderIter.__init__``), called from ``_get_iterator``
    (stateful_dataloader.py:381-389); ``DataLoader`` refuses to set ``dataset`` after ``__init__``, so the
    instance dict holds the other one only while the iterator is made."""

    def worker_dataset(self) -> Any:
        return self.dataset

    @override
    def _get_iterator(self) -> Any:
        dataset, shown = self.dataset, self.worker_dataset()
        if shown is dataset:
            return super()._get_iterator()
        self.__dict__["dataset"] = shown
        try:
            return super()._get_iterator()
        finally:
            self.__dict__["dataset"] = dataset


def become_stateful(loader: tud.DataLoader, cls: type[StatefulDataLoader]) -> None:
    """Make a constructed ``DataLoader`` a ``cls`` (a ``StatefulDataLoader`` subclass) in place: the attributes
    ``StatefulDataLoader.__init__`` adds to ``DataLoader``'s (stateful_dataloader.py:371-377), defaults as there.
    Its ``__init__`` is not run, so torch's deprecated ``set_vital`` call (:379) and its warning are skipped."""
    loader.__class__ = cls
    vars(loader).update(snapshot_every_n_steps=1, next_iter_state=None, _initial_iter_for_state_dict=False)


def become_plain(loader: StatefulDataLoader, cls: type[tud.DataLoader]) -> None:
    """Undo :func:`become_stateful`: ``cls`` again, the iterator torchdata kept (:396-408) dropped."""
    for name in ("snapshot_every_n_steps", "next_iter_state", "_initial_iter_for_state_dict"):
        vars(loader).pop(name, None)
    vars(loader)["_iterator"] = None  # torch's DataLoader keeps one only for persistent workers, of its own kind
    loader.__class__ = cls


def stateful_batch_sampler(batch_sampler: tud.BatchSampler) -> None:
    """torch's ``BatchSampler`` made torchdata's in place: the same fields, an iterator with a position
    (sampler.py:170-179, no attribute of its own)."""
    batch_sampler.__class__ = BatchSampler


def plain_batch_sampler(batch_sampler: BatchSampler) -> None:
    batch_sampler.__class__ = tud.BatchSampler


def stateful_distributed_sampler(sampler: tud.DistributedSampler) -> None:
    """torch's ``DistributedSampler`` made ``StatefulDistributedSampler`` in place: the same order (it calls
    ``DistributedSampler.__iter__``) and the counters its ``__init__`` adds (sampler.py:195-196)."""
    sampler.__class__ = StatefulDistributedSampler
    vars(sampler).update(yielded=0, next_yielded=None)


def plain_distributed_sampler(sampler: StatefulDistributedSampler) -> None:
    for name in ("yielded", "next_yielded"):
        vars(sampler).pop(name, None)
    sampler.__class__ = tud.DistributedSampler
