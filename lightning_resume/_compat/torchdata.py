"""Every use of torchdata's private ``StatefulDataLoader`` state layout, in one place (torchdata 0.11).

``StatefulDataLoader.state_dict()`` is a dict whose keys are private constants of torchdata's iterator
and sampler classes. ``ExactResume`` reads them to describe a position (``inspect``) and to move a
single-process position to another world size. The keys are imported from the classes that define
them, so a rename fails here at import, not silently in a remapped position.
"""

from __future__ import annotations

from typing import Any, Mapping

from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler, _BatchSamplerIterator
from torchdata.stateful_dataloader.stateful_dataloader import (
    _SAMPLER_ITER_STATE,
    _SAMPLER_ITER_YIELDED,
    _StatefulMultiProcessingDataLoaderIter,
    _StatefulSingleProcessDataLoaderIter,
)

_NUM_YIELDED = _StatefulSingleProcessDataLoaderIter._NUM_YIELDED  # stateful_dataloader.py:465
_SNAPSHOT = _StatefulMultiProcessingDataLoaderIter._SNAPSHOT  # :893
_WORKER_SNAPSHOTS = _StatefulMultiProcessingDataLoaderIter._WORKER_SNAPSHOTS  # :895
_SNAPSHOT_STEP = _StatefulMultiProcessingDataLoaderIter._SNAPSHOT_STEP  # :896
_SAMPLES_YIELDED = _BatchSamplerIterator._SAMPLES_YIELDED  # sampler.py:116
_SAMPLER_STATE = _BatchSamplerIterator._SAMPLER_STATE  # sampler.py:117
_YIELDED = StatefulDistributedSampler._YIELDED  # sampler.py:183


def describe_position(state: Any) -> str:
    """How far a saved loader state is into its epoch, in words."""
    if not isinstance(state, Mapping):
        return "none (not a StatefulDataLoader)"
    snapshot = state.get(_SNAPSHOT) or {}
    workers = len(snapshot.get(_WORKER_SNAPSHOTS) or {})
    if _SNAPSHOT_STEP in snapshot:  # multiprocess loader: batches yielded = the snapshot's step
        return f"{snapshot[_SNAPSHOT_STEP]} batches yielded, {workers} worker states"
    return f"{state.get(_NUM_YIELDED)} batches yielded"


def distributed_samples_yielded(state: Mapping[str, Any]) -> int:
    """Samples a single-process loader over a ``StatefulDistributedSampler`` has yielded this epoch on its rank.

    ``ValueError`` for any other state (worker snapshots, no sampler counter).
    """
    iter_state = state.get(_SAMPLER_ITER_STATE) or {}
    sampler_state = iter_state.get(_SAMPLER_STATE) or {}
    if _YIELDED not in sampler_state or _SAMPLES_YIELDED not in iter_state or _SNAPSHOT in state:
        raise ValueError("only num_workers=0 loaders with a StatefulDistributedSampler can be remapped")
    return int(sampler_state[_YIELDED])


def with_position(state: Mapping[str, Any], batches: int, samples: int) -> dict[str, Any]:
    """``state`` (as accepted by :func:`distributed_samples_yielded`) moved to ``batches`` batches and
    ``samples`` samples into the epoch."""
    iter_state = state[_SAMPLER_ITER_STATE]
    sampler_state = dict(iter_state[_SAMPLER_STATE], **{_YIELDED: samples})
    new = dict(state, **{_NUM_YIELDED: batches, _SAMPLER_ITER_YIELDED: batches})
    new[_SAMPLER_ITER_STATE] = dict(iter_state, **{_SAMPLES_YIELDED: samples, _SAMPLER_STATE: sampler_state})
    return new
