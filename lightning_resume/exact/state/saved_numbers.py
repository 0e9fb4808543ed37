"""The numbers of an ``ExactResume`` state checked before a restore uses them: one line per bad field.

A checkpoint is a file anyone may have edited. The restore sizes lists by its world size, builds a sampler's
order from its sample count and seed, and picks this rank's entry by a modulo of its rank list's length, so
an edited state of a few KB could cost gigabytes and minutes or end in a raw ``ZeroDivisionError``. Here
every such number is checked for its type and its range: the world size against the rank entries the file
actually holds (so the file's size bounds it), a plan's indices and start against the live dataset's length,
the batches handed out against the epoch's samples, a sampler's arguments alike on every rank (that its
sample count is the live dataset's is ``elastic.unremappable``'s: a mismatch with the run). Pure: reads the
state dict and the live facts passed in, in time and memory bounded by the state's own size (a plan's
indices are checked with one min and max); knows neither Lightning nor files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

MAX_WORLD_SIZE = 1 << 20
"""More processes than any run has: a larger saved world size is an edited one."""

MAX_COUNT = 1 << 40
"""The bound of a sample or batch count where no live dataset length bounds it."""

MAX_ACCUMULATE = 1 << 20
MAX_EPOCH = 1 << 31
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
"""What ``torch.Generator.manual_seed`` accepts (a distributed sampler seeds with ``seed + epoch``)."""

MAX_LINES = 8
"""Problems named in one error (an edited state of many ranks would otherwise list each)."""


@dataclass(frozen=True)
class Live:
    """What the run resuming the state knows: whether the state is dealt to another world size (its order
    records are then used), and the length of train loader 0's dataset under a distributed sampler."""

    moved: bool
    dataset_length: Optional[int]
    rng_bytes: int = 5056
    """The size of torch's CPU generator state (``torch.get_rng_state().numel()``, its Mersenne Twister's)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_line(field: str, value: Any, low: int, high: int) -> Optional[str]:
    if not _is_int(value):
        return f"{field} = {_short(value)}: not an integer"
    if not low <= value <= high:
        return f"{field} = {value}: outside {low}..{high}"
    return None


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, torch.Tensor) else f"a tensor of shape {tuple(value.shape)}"
    return text if len(text) <= 60 else text[:57] + "..."


def problems(saved: Mapping[str, Any], live: Live, yielded: Callable[[Mapping[str, Any]], int]) -> list[str]:
    """Every bad number of ``saved`` (the ``ExactResume`` entry), at most ``MAX_LINES``, one line each naming
    the field. ``yielded``: the batches a saved loader state says its loader had handed out (torchdata's
    layout). A state that fits no run is named here; one written for another dataset is ``unremappable``'s."""
    bad: list[str] = []
    ranks = saved.get("ranks")
    bad += _world_lines(saved.get("world_size"), ranks)
    if "accumulate" in saved:
        bad += _optional(_int_line("accumulate", saved["accumulate"], 1, MAX_ACCUMULATE))
    if not isinstance(saved.get("captured_at", ""), str):
        bad.append(f"captured_at = {_short(saved['captured_at'])}: not a str")
    bad += _signature_lines(saved.get("signature", {}))
    if isinstance(ranks, list):
        for rank, state in enumerate(ranks):
            if len(bad) >= MAX_LINES:
                break
            bad += _rank_lines(f"ranks[{rank}]", state, live, yielded)
        if not bad:
            bad += _agreement_lines(ranks)
    return bad[:MAX_LINES]


def _signature_lines(signature: Any) -> list[str]:
    """The saved run's structure (``capture.signature``): its loaders' records, each batch size a count."""
    if not isinstance(signature, Mapping) or not isinstance(signature.get("loaders", []), list):
        return [f"signature = {_short(signature)}: not a run's signature (a dict with a list of loaders)"]
    bad = []
    for i, loader in enumerate(signature.get("loaders", [])):
        if not isinstance(loader, Mapping):
            bad.append(f"signature.loaders[{i}] = {_short(loader)}: not a loader's signature (a dict)")
        elif loader.get("batch_size") is not None:
            bad += _optional(_int_line(f"signature.loaders[{i}].batch_size", loader["batch_size"], 1, MAX_COUNT))
    return bad


def _optional(line: Optional[str]) -> list[str]:
    return [] if line is None else [line]


def _world_lines(world: Any, ranks: Any) -> list[str]:
    """The world size: a positive int, at most ``MAX_WORLD_SIZE``, and the number of rank entries held."""
    if not isinstance(ranks, list) or not ranks:
        what = "an empty list" if isinstance(ranks, list) else _short(ranks)
        return [f"ranks = {what}: the state holds no rank's entry (one per saving process is written)"]
    line = _int_line("world_size", world, 1, MAX_WORLD_SIZE)
    if line is not None:
        return [line]
    if world != len(ranks):
        return [f"world_size = {world}: the state holds {len(ranks)} rank entries, one per saving process"]
    return []


SHARED = ("length", "shuffle", "seed", "drop_last", "epoch")
"""What every rank's distributed sampler of one loader holds alike (the rank aside): one order of the epoch."""


def _agreement_lines(ranks: list[Any]) -> list[str]:
    """Train loader 0's sampler arguments, the same on every rank (so the epoch's order is made once)."""
    records = [(state.get("orders") or [{}])[0] for state in ranks]
    first = records[0]
    for rank, record in enumerate(records):
        if "length" in first and "length" in record:
            differ = [key for key in SHARED if record.get(key) != first.get(key)]
            if differ:
                return [
                    f"ranks[{rank}].orders[0].{differ[0]} = {_short(record.get(differ[0]))}: rank 0 saved"
                    f" {_short(first.get(differ[0]))}, and one sampler's arguments are the same on every rank"
                ]
    return []


REQUIRED = {"rng": Mapping, "loaders": list, "epoch_exhausted": bool, "validation_pending": bool}
"""The entries a restore reads from each rank's state, and their types."""


def _rank_lines(name: str, state: Any, live: Live, yielded: Callable[[Mapping[str, Any]], int]) -> list[str]:
    if not isinstance(state, Mapping):
        return [f"{name} = {_short(state)}: not a rank's state (a dict)"]
    bad = [
        f"{name}.{key} = {_short(state.get(key))}: not a {kind.__name__}"
        for key, kind in REQUIRED.items()
        if not isinstance(state.get(key), kind)
    ]
    if "epoch" in state:
        bad += _optional(_int_line(f"{name}.epoch", state["epoch"], 0, MAX_EPOCH))
    if isinstance(state.get("rng"), Mapping):
        bad += _rng_lines(f"{name}.rng", state["rng"], live.rng_bytes)
    orders = state.get("orders")
    if orders is None:
        return bad
    if not isinstance(orders, list):
        return [*bad, f"{name}.orders = {_short(orders)}: not a list"]
    for i, record in enumerate(orders):
        # train loader 0: the one an elastic resume deals, whose live dataset length is known
        bad += _order_lines(f"{name}.orders[{i}]", record, live.dataset_length if i == 0 else None)
    if live.moved and not bad:
        bad += _yielded_lines(name, state, orders, yielded)
    return bad


def _order_lines(name: str, record: Any, length: Optional[int]) -> list[str]:
    """One loader's order record (``data.order_record``): the sampler's arguments, its epoch, its plan
    (whose indices must be samples of the live dataset, of ``length`` where known)."""
    if not isinstance(record, Mapping):
        return [f"{name} = {_short(record)}: not a loader's order record (a dict)"]
    if "length" not in record:
        return []  # another kind of sampler: only its name is recorded, and an elastic resume refuses it
    bad = _optional(_int_line(f"{name}.length", record["length"], 0, MAX_COUNT))
    bad += [
        f"{name}.{key} = {_short(record.get(key))}: not a bool"
        for key in ("shuffle", "drop_last")
        if not isinstance(record.get(key), bool)
    ]
    bad += _optional(_int_line(f"{name}.epoch", record.get("epoch"), 0, MAX_EPOCH))
    bad += _optional(_int_line(f"{name}.seed", record.get("seed"), *SEED_RANGE))
    if not bad:  # the sampler seeds its generator with their sum
        bad += _optional(_int_line(f"{name}.seed + epoch", record["seed"] + record["epoch"], *SEED_RANGE))
    if record.get("plan") is not None:
        bad += _plan_lines(f"{name}.plan", record["plan"], length)
    return bad


def _plan_lines(name: str, plan: Any, length: Optional[int]) -> list[str]:
    """An epoch an earlier elastic resume dealt (``samplers.EpochPlan.to_state``): its indices name samples of
    the dataset, its start is a count of batches."""
    if not isinstance(plan, Mapping):
        return [f"{name} = {_short(plan)}: not a plan (a dict)"]
    high = MAX_COUNT if length is None else length
    bad = _optional(_int_line(f"{name}.epoch", plan.get("epoch"), 0, MAX_EPOCH))
    bad += _optional(_int_line(f"{name}.start", plan.get("start"), 0, high))
    indices = plan.get("indices")
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or indices.dtype != torch.int64:
        return [*bad, f"{name}.indices = {_short(indices)}: not a 1-D int64 tensor"]
    if indices.numel() > high:
        bad.append(f"{name}.indices: {indices.numel()} of them, more than the {high} samples of the dataset")
    elif indices.numel() and not (int(indices.min()) >= 0 and int(indices.max()) < high):
        bad.append(f"{name}.indices: from {int(indices.min())} to {int(indices.max())}, not samples 0..{high - 1}")
    return bad


def _yielded_lines(
    name: str, state: Mapping[str, Any], orders: Sequence[Any], yielded: Callable[[Mapping[str, Any]], int]
) -> list[str]:
    """On another world size, the batches train loader 0 had handed out: a count no larger than its samples."""
    loaders, record = state["loaders"], orders[0] if orders else {}
    loader_state = loaders[0] if loaders else None
    if loader_state is None or "length" not in record:
        return []
    if not isinstance(loader_state, Mapping):
        return [f"{name}.loaders[0] = {_short(loader_state)}: not a loader's state (a dict)"]
    try:
        count = yielded(loader_state)
    except (TypeError, ValueError, KeyError, OverflowError):
        return [f"{name}.loaders[0]: its count of batches handed out is not an integer"]
    return _optional(_int_line(f"{name}.loaders[0] batches handed out", count, 0, record["length"]))


MT_WORDS = 624
"""The Mersenne Twister's state words (Python's ``random`` and NumPy's ``MT19937``), each below 2**32."""


def _rng_lines(name: str, rng: Mapping[str, Any], torch_bytes: int) -> list[str]:
    """The saved random streams (``rng.capture_rng``): tensors of the generators' own sizes, words in range."""
    bad = []
    if not _tensor_of(rng.get("torch"), torch.uint8, torch_bytes):
        bad.append(f"{name}.torch = {_short(rng.get('torch'))}: not torch's {torch_bytes}-byte generator state")
    python: Any = rng.get("python")
    numpy: Any = rng.get("numpy")
    words: Any = python.get("state") if isinstance(python, Mapping) else None
    if not (_tensor_of(words, torch.int64, MT_WORDS + 1) and _words_in_range(words[:MT_WORDS])):
        bad.append(f"{name}.python.state = {_short(words)}: not Python random's {MT_WORDS + 1} state words")
    elif not (_is_int(python.get("version")) and isinstance(python.get("gauss_next"), (float, type(None)))):
        bad.append(f"{name}.python: its version or gauss_next is not a number")
    elif not 0 <= int(words[MT_WORDS]) <= MT_WORDS:
        bad.append(f"{name}.python.state: its position {int(words[MT_WORDS])} is outside 0..{MT_WORDS}")
    key: Any = numpy.get("key") if isinstance(numpy, Mapping) else None
    if not (_tensor_of(key, torch.int64, MT_WORDS) and _words_in_range(key)):
        bad.append(f"{name}.numpy.key = {_short(key)}: not NumPy's {MT_WORDS} MT19937 words")
    elif not _numpy_numbers(numpy):
        bad.append(f"{name}.numpy: its pos, has_gauss, gauss or bit_generator is not MT19937's")
    cuda = rng.get("cuda") or []
    if not isinstance(cuda, list) or not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda):
        bad.append(f"{name}.cuda = {_short(cuda)}: not a list of CUDA generator states")
    return bad


def _numpy_numbers(numpy: Mapping[str, Any]) -> bool:
    return (
        numpy.get("bit_generator") == "MT19937"
        and _int_line("pos", numpy.get("pos"), 0, MT_WORDS) is None
        and _int_line("has_gauss", numpy.get("has_gauss"), 0, 1) is None
        and isinstance(numpy.get("gauss"), float)
    )


def _tensor_of(value: Any, dtype: torch.dtype, size: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == dtype and tuple(value.shape) == (size,)


def _words_in_range(words: torch.Tensor) -> bool:
    return bool(words.numel() == 0 or (int(words.min()) >= 0 and int(words.max()) < 1 << 32))
