"""Which blocks to recompute: the pure activation-checkpointing policy.

This module owns the decision only. It reads plain records of a model's blocks (qualified name,
class paths, container, parameter count and, when measured, saved-activation bytes) and returns a
:class:`CheckpointPlan`: the *units* to recompute in backward, each a run of one or more
consecutive blocks. It never imports Lightning or torch, never touches a module, never reads a
clock. The mechanism (``apply.py``) applies a plan; the strategies (``strategies.py``) gather records.

Selection modes (over the *candidates*: the outermost blocks matching the classes and/or the glob):

- ``"all"``: every candidate is its own unit.
- ``"every"``: candidates ``0, k, 2k, ...`` (in model order) are units.
- ``"sqrt"``: Chen et al. (2016) segments. Each *chain* (a run of candidates that are consecutive
  children of one ``nn.Sequential``) of ``m`` blocks is cut into ``ceil(sqrt(m))`` contiguous
  segments whose lengths differ by at most one (longer first). A segment is recomputed as a whole:
  forward keeps only its input, and in backward one segment's internals live at a time. So the
  activations kept are about ``sqrt(m)`` segment inputs plus, transiently, ``m / sqrt(m)`` blocks.
- ``"budget"``: the fewest single-block units whose measured savings bring the estimated saved
  bytes at the end of forward to at most ``budget_bytes`` (largest savings first).
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

from lightning_resume.errors import ConfigurationError

OWNER = "activation checkpointing"
Mode = Literal["all", "every", "sqrt", "budget"]
MODES: tuple[str, ...] = ("all", "every", "sqrt", "budget")


@dataclass(frozen=True)
class BlockRecord:
    """One module of the model, as the policy sees it.

    ``saved_bytes``: bytes its forward saves for backward, excluding its own inputs and parameters
    (what recomputing it frees). ``input_bytes``: bytes of its tensor inputs that something saves
    (freed too when it is recomputed inside a segment, not at a segment's head).
    """

    name: str
    class_paths: tuple[str, ...]
    container: str = ""
    sequential: bool = False
    position: int = 0
    params: int = 0
    saved_bytes: Optional[int] = None
    input_bytes: Optional[int] = None


@dataclass(frozen=True)
class BlockSelection:
    """What the user asked for; validated at construction, every problem reported at once."""

    classes: tuple[str, ...] = ()
    pattern: Optional[str] = None
    mode: Mode = "all"
    every: Optional[int] = None
    budget_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        problems = _selection_problems(self)
        if problems:
            raise ConfigurationError(OWNER, problems)

    @property
    def needs_measurement(self) -> bool:
        return self.mode == "budget"

    def describe(self) -> str:
        parts = [
            f"classes={list(self.classes)}" if self.classes else "",
            f"pattern={self.pattern!r}" if self.pattern else "",
        ]
        return ", ".join(p for p in parts if p)


def _selection_problems(sel: BlockSelection) -> list[str]:
    problems = []
    if not sel.classes and not sel.pattern:
        problems.append(
            "no blocks chosen: give blocks=<class or class path> and/or pattern=<glob like 'model.layers.*'>"
        )
    if sel.mode not in MODES:
        problems.append(f"select={sel.mode!r} is unknown; use one of {list(MODES)}")
    if sel.mode == "every" and (sel.every is None or sel.every < 1):
        problems.append(f"select='every' needs every=k with k >= 1 (got every={sel.every!r})")
    if sel.mode != "every" and sel.every is not None:
        problems.append(f"every={sel.every!r} is only used with select='every' (got select={sel.mode!r})")
    if sel.mode == "budget" and (sel.budget_bytes is None or sel.budget_bytes < 0):
        problems.append(f"select='budget' needs budget=<bytes >= 0> (got budget={sel.budget_bytes!r})")
    if sel.mode != "budget" and sel.budget_bytes is not None:
        problems.append(f"budget={sel.budget_bytes!r} is only used with select='budget' (got select={sel.mode!r})")
    return problems


@dataclass(frozen=True)
class CheckpointPlan:
    """The decision: units to recompute (each a tuple of consecutive block names), and estimates.

    ``bytes_before``/``bytes_after``: estimated saved-activation bytes kept at the end of forward
    without and with the plan (``None`` when not measured). ``extra_forward``: the fraction of one
    forward pass recomputed in backward, estimated by the parameter share of the recomputed blocks.
    ``peak_recompute_bytes``: the largest unit's internals, alive only while it is recomputed.
    """

    mode: str
    units: tuple[tuple[str, ...], ...]
    candidates: int
    extra_forward: float
    bytes_before: Optional[int] = None
    bytes_after: Optional[int] = None
    peak_recompute_bytes: Optional[int] = None
    notes: tuple[str, ...] = field(default=())

    @property
    def blocks(self) -> tuple[str, ...]:
        return tuple(name for unit in self.units for name in unit)

    def describe(self) -> str:
        head = f"activation checkpointing ({self.mode}): {len(self.units)} unit(s) over {len(self.blocks)} of {self.candidates} candidate block(s)"
        lines = [head]
        if self.bytes_before is not None and self.bytes_after is not None:
            saved = self.bytes_before - self.bytes_after
            lines.append(
                f"  saved activations: {_fmt_bytes(self.bytes_before)} -> {_fmt_bytes(self.bytes_after)} (estimated {_fmt_bytes(saved)} saved;"
                f" + up to {_fmt_bytes(self.peak_recompute_bytes or 0)} while one unit is recomputed)"
            )
        lines.append(f"  extra compute: about {self.extra_forward:.2f} of one forward pass (parameter share)")
        lines.extend(f"  unit {i}: {_fmt_unit(unit)}" for i, unit in enumerate(self.units))
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def _fmt_unit(unit: tuple[str, ...]) -> str:
    return unit[0] if len(unit) == 1 else f"{unit[0]} .. {unit[-1]} ({len(unit)} blocks)"


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def select_candidates(records: Sequence[BlockRecord], selection: BlockSelection) -> list[BlockRecord]:
    """The outermost records matching the classes (any class in the MRO) and/or the glob, in model order."""
    wanted = set(selection.classes)
    matches = [r for r in records if r.name and _matches(r, wanted, selection.pattern)]
    outermost = [r for r in matches if not any(_is_ancestor(o.name, r.name) for o in matches)]
    if not outermost:
        raise ConfigurationError(OWNER, [_nothing_matched(records, selection)])
    return outermost


def _matches(record: BlockRecord, classes: set[str], pattern: Optional[str]) -> bool:
    if classes and not classes.intersection(record.class_paths):
        return False
    return pattern is None or fnmatch.fnmatchcase(record.name, pattern)


def _is_ancestor(prefix: str, name: str) -> bool:
    return prefix != name and (prefix == "" or name.startswith(prefix + "."))


def _nothing_matched(records: Sequence[BlockRecord], selection: BlockSelection) -> str:
    names = [r.name for r in records if r.name][:6]
    kinds = sorted({r.class_paths[0] for r in records if r.class_paths})[:6]
    return (
        f"no module matches {selection.describe()}; the model has modules such as {names}"
        f" of classes such as {kinds}: fix the class path or the glob"
    )


def plan_checkpointing(
    records: Sequence[BlockRecord], selection: BlockSelection, total_bytes: Optional[int] = None
) -> CheckpointPlan:
    """Decide the units to recompute. ``total_bytes``: measured saved bytes of the whole forward."""
    candidates = select_candidates(records, selection)
    if selection.needs_measurement and (total_bytes is None or any(c.saved_bytes is None for c in candidates)):
        raise ConfigurationError(OWNER, ["select='budget' needs measured saved bytes for every candidate block"])
    if selection.mode == "budget":
        units, notes = _budget_units(candidates, total_bytes or 0, selection.budget_bytes or 0)
    elif selection.mode == "sqrt":
        units, notes = _sqrt_units(candidates), ()
    else:
        step = selection.every if selection.mode == "every" else 1
        units, notes = tuple((c.name,) for c in candidates[:: step or 1]), ()
    return _estimate(selection.mode, candidates, records, units, total_bytes, notes)


def _budget_units(
    candidates: list[BlockRecord], total: int, budget: int
) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...]]:
    ranked = sorted(range(len(candidates)), key=lambda i: (-(candidates[i].saved_bytes or 0), i))
    chosen: list[int] = []
    remaining = total
    for i in ranked:
        if remaining <= budget:
            break
        chosen.append(i)
        remaining -= candidates[i].saved_bytes or 0
    if remaining > budget:
        raise ConfigurationError(
            OWNER,
            [
                f"budget={budget} bytes cannot be met: recomputing all {len(candidates)} candidate blocks still keeps"
                f" about {remaining} bytes ({_fmt_bytes(remaining)}); raise the budget to >= {remaining},"
                " choose more blocks, or use a smaller batch"
            ],
        )
    notes = ("the model already fits the budget; nothing is recomputed",) if not chosen else ()
    return tuple((candidates[i].name,) for i in sorted(chosen)), notes


def _sqrt_units(candidates: list[BlockRecord]) -> tuple[tuple[str, ...], ...]:
    units: list[tuple[str, ...]] = []
    for chain in _chains(candidates):
        if len(chain) > 1 and not chain[0].sequential:
            raise ConfigurationError(
                OWNER,
                [
                    f"select='sqrt' recomputes runs of consecutive blocks, which needs them to be consecutive children of an"
                    f" nn.Sequential; the blocks under {chain[0].container!r} are not: use select='all', 'every' or 'budget'"
                ],
            )
        units.extend(tuple(c.name for c in seg) for seg in split_evenly(chain, math.ceil(math.sqrt(len(chain)))))
    return tuple(units)


def _chains(candidates: list[BlockRecord]) -> list[list[BlockRecord]]:
    """Runs of candidates that are consecutive siblings in the same container."""
    chains: list[list[BlockRecord]] = []
    for c in candidates:
        last = chains[-1][-1] if chains else None
        if last is not None and last.container == c.container and last.position + 1 == c.position:
            chains[-1].append(c)
        else:
            chains.append([c])
    return chains


def split_evenly(items: Sequence, parts: int) -> list[list]:
    """``parts`` contiguous slices of ``items`` whose lengths differ by at most one, longer first."""
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out


def _estimate(
    mode: str,
    candidates: list[BlockRecord],
    records: Sequence[BlockRecord],
    units: tuple[tuple[str, ...], ...],
    total: Optional[int],
    notes: tuple[str, ...],
) -> CheckpointPlan:
    by_name = {c.name: c for c in candidates}
    root_params = max((r.params for r in records), default=0) or 1  # the root holds every parameter
    extra = sum(by_name[n].params for unit in units for n in unit) / root_params
    before = after = peak = None
    if total is not None and all(c.saved_bytes is not None for c in candidates):
        freed = [
            sum((by_name[n].saved_bytes or 0) + (by_name[n].input_bytes or 0) * (j > 0) for j, n in enumerate(u))
            for u in units
        ]
        before, after, peak = total, total - sum(freed), max(freed, default=0)
    return CheckpointPlan(mode, units, len(candidates), extra, before, after, peak, notes)


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def parse_bytes(value: int | str | None, name: str) -> Optional[int]:
    """``1048576``, ``"512MiB"``, ``"1.5 GB"`` -> bytes (``None`` stays ``None``)."""
    if value is None or isinstance(value, int):
        return value
    text = str(value).strip().lower().replace(" ", "")
    number = text.rstrip("kmgib")
    unit = text[len(number) :]
    try:
        if unit not in _BYTE_UNITS:
            raise ValueError(unit)
        return int(float(number) * _BYTE_UNITS[unit])
    except ValueError as err:
        raise ConfigurationError(
            OWNER, [f"{name}={value!r} is not a size; use bytes or a string like '512MiB'"]
        ) from err
