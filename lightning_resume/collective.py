"""Agreement between ranks: small collectives that every rank calls, and outcomes every rank learns.

The rule this module keeps: a decision taken on one rank (save now, refuse this checkpoint, a failed
write) is never acted on alone, since a rank that saves or raises by itself leaves the others waiting
in their next collective. Everything works without an initialised process group (one process: the
local value is the answer). Knows ``torch.distributed``, not Lightning or files.
"""

from __future__ import annotations

from collections import OrderedDict
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional, Sequence, TypeVar, cast

import torch
import torch.distributed as dist

from lightning_resume.errors import AsyncWriteError, RanksOutOfStepError

T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group, ``(0, 1)`` without one."""
    return (dist.get_rank(), dist.get_world_size()) if is_distributed() else (0, 1)


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def broadcast(obj: T) -> T:
    """Rank 0's ``obj`` on every rank."""
    if not is_distributed():
        return obj
    box = [_to_wire(obj)]
    dist.broadcast_object_list(box, src=0)
    return cast(T, _from_wire(box[0]))


def gather(local: T, world_size: Optional[int] = None) -> list[T]:
    """Every rank's value, in rank order, on every rank. ``world_size`` defaults to the process group's."""
    if not is_distributed():
        return [local]
    world_size = dist.get_world_size() if world_size is None else world_size
    if world_size <= 1:
        return [local]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, _to_wire(local))
    return [_from_wire(x) for x in out]


class _WireTensor:
    """A CPU tensor as raw bytes for the object collectives: pickling a tensor itself calls ``torch.save``
    (its storage's ``__reduce__``), which a user's code or Lightning's own tests may count or patch."""

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, t: torch.Tensor) -> None:
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        self.dtype, self.shape = str(t.dtype).removeprefix("torch."), tuple(t.shape)
        self.data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""

    def tensor(self) -> torch.Tensor:
        dtype = getattr(torch, self.dtype)
        raw = (
            torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
            if self.data
            else torch.empty(0, dtype=torch.uint8)
        )
        return raw.view(dtype).reshape(self.shape)


def _to_wire(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return _WireTensor(obj)
    if type(obj) in (list, tuple):
        return type(obj)(_to_wire(x) for x in obj)
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, _to_wire(v)) for k, v in obj.items())
    return obj


def _from_wire(obj: Any) -> Any:
    if isinstance(obj, _WireTensor):
        return obj.tensor()
    if type(obj) in (list, tuple):
        return type(obj)(_from_wire(x) for x in obj)
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, _from_wire(v)) for k, v in obj.items())
    return obj


def all_arrive(what: str, timeout_s: float) -> None:
    """Wait until every rank reaches this point, at most ``timeout_s``; else ``RanksOutOfStepError`` on every
    rank that did, naming the ranks that did not (gloo's ``monitored_barrier``).

    For the points where ranks may have taken different paths (each resolved its own checkpoint), so a
    rank that is elsewhere gives a named error in bounded time instead of a hang in the next collective.
    Other backends (NCCL) have no monitored barrier; their own watchdog timeout applies.
    """
    if not is_distributed() or dist.get_world_size() <= 1 or dist.get_backend() != "gloo":
        return
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as err:
        detail = " ".join(str(err).split())
        raise RanksOutOfStepError(what, timeout_s, f"rank {dist.get_rank()}: {detail[:500]}") from err


_waits = 0
"""How many ``wait_for_rank_zero`` calls this process made: every rank makes them in the same order, so the
count names the store key they meet on."""


def wait_for_rank_zero(what: str, work: Callable[[], None], timeout_s: float, failure: Failure) -> None:
    """Rank 0 runs ``work`` (a wait on its own I/O, such as a background write); every other rank waits until it
    is done, on the process group's store, not in a collective: a collective has the group's timeout (NCCL's
    watchdog, gloo's), which a slow write must not run into. An error ``work`` raises on rank 0 is raised there
    and, as ``failure({0: description})``, on every other rank; a rank that waited ``timeout_s`` (or lost the
    store: rank 0's process hosts it) raises ``RanksOutOfStepError``. Without a process group, ``work`` runs here."""
    global _waits
    if not is_distributed() or dist.get_world_size() <= 1:
        work()
        return
    from lightning_resume._compat.torch_ops import default_store

    _waits += 1
    store, key = default_store(), f"lightning-resume/wait/{_waits}"
    if dist.get_rank() == 0:
        try:
            work()
        except BaseException as err:
            store.set(key, f"failed: {describe(err)}")
            raise
        store.set(key, "done")
        return
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except RuntimeError as err:  # the store's timeout, or rank 0 gone (its process hosts the store)
        raise RanksOutOfStepError(
            what, timeout_s, f"rank {dist.get_rank()}: {' '.join(str(err).split())[:300]}"
        ) from err
    outcome = store.get(key).decode()
    if outcome != "done":
        raise failure({0: outcome.removeprefix("failed: ")})


WRITE_WAIT_SLACK_S = 3600.0
"""How much longer than a writer's own ``flush_timeout`` the other ranks wait for rank 0's background write
before they raise ``RanksOutOfStepError`` (a slow bucket may take long; a dead rank 0 ends the wait at once)."""


def wait_for_rank_zero_writes(writer: Any, what: str) -> None:
    """``wait_for_rank_zero`` on an async checkpoint writer (``protocols.AsyncCheckpointWriter``): every rank
    leaves once rank 0's pending writes are durable; their failure is raised on every rank."""

    def failed(problems: Mapping[int, str]) -> BaseException:
        return AsyncWriteError("of rank 0", RuntimeError(problems[0]))

    wait_for_rank_zero(what, writer.wait, float(writer.flush_timeout) + WRITE_WAIT_SLACK_S, failed)


def agreed(lines: list[str]) -> list[str]:
    """Every rank's lines on every rank, so that all ranks refuse (or warn) together. Lines not seen on
    every rank say which ranks saw them."""
    per_rank = gather(lines)
    if len(per_rank) == 1:
        return lines
    out: dict[str, list[int]] = {}
    for rank, rank_lines in enumerate(per_rank):
        for line in rank_lines:
            out.setdefault(line, []).append(rank)
    return [line if len(ranks) == len(per_rank) else f"{line} (ranks {ranks})" for line, ranks in out.items()]


def max_over_ranks(values: Sequence[int], device: Optional[torch.device] = None) -> list[int]:
    """Element-wise max over ranks: rank 0's decision reaches all, any rank's flag counts.

    ``device`` is where the collective's tensor lives (the backend's device: CUDA for NCCL)."""
    if not is_distributed() or dist.get_world_size() <= 1:
        return list(values)
    tensor = torch.tensor(list(values), dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [int(v) for v in tensor.tolist()]


def describe(error: Optional[BaseException]) -> Optional[str]:
    """One line naming an error, to be sent to other ranks (exceptions themselves may not pickle)."""
    return None if error is None else f"{type(error).__name__}: {error}"


Failure = Callable[[Mapping[int, str]], BaseException]
"""Builds the error every rank raises from ``{rank: problem}``."""


def on_every_rank(fn: Callable[[], T], failure: Failure) -> list[T]:
    """Run ``fn`` on every rank and gather the results; if any rank failed, every rank raises ``failure(problems)``."""
    value, error = None, None
    try:
        value = fn()
    except Exception as err:  # noqa: BLE001 - handed to every rank below; re-raised chained on this one
        error = err
    outcomes = gather((describe(error), value))
    problems = {rank: problem for rank, (problem, _) in enumerate(outcomes) if problem is not None}
    if problems:
        raise failure(problems) from error
    return [cast(T, v) for _, v in outcomes]  # no rank failed, so every value is a T


def on_rank_zero(fn: Callable[[], T], failure: Failure) -> T:
    """Run ``fn`` on rank 0 only and broadcast its result, or its error to be raised on every rank."""
    value, error = None, None
    if rank_and_world()[0] == 0:
        try:
            value = fn()
        except Exception as err:  # noqa: BLE001 - broadcast below; re-raised chained on rank 0
            error = err
    problem, value = broadcast((describe(error), value))
    if problem is not None:
        raise failure({0: problem}) from error
    return cast(T, value)  # rank 0 succeeded, so this is its T
