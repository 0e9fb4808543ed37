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
- ``"budget"``: single-block units that bring the estimated saved bytes at the end of forward to
  at most ``budget_bytes`` at the least recompute (see below).

How a unit is recomputed (``recompute``): ``"full"`` keeps only the unit's input and reruns its
whole forward in backward; ``"selective"`` also keeps the outputs of the ops named in ``save_ops``
(matmuls, attention, convolutions by default: expensive to rerun, cheap to keep) and reruns only the
rest (norms, activations, elementwise ops, dropout with the same mask).

The budget planner treats each candidate block as a choice among ``none`` (nothing recomputed),
``full`` and, with ``recompute="selective"``, ``selective``. Each choice frees some bytes (measured:
the block's saved bytes, minus what selective recomputation still keeps) and costs some recompute
(measured forward seconds of the block, or of the ops selective recomputation reruns; when no times
are measured, one unit per fully recomputed block, i.e. the fewest blocks). The plan is the cheapest
combination that frees enough, found exactly over the Pareto frontier of (cost, bytes freed), with
ties going to more bytes freed, then fewer recomputed blocks.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence

from lightning_resume.errors import ConfigurationError

OWNER = "activation checkpointing"
Mode = Literal["all", "every", "sqrt", "budget"]
MODES: tuple[str, ...] = ("all", "every", "sqrt", "budget")
Recompute = Literal["full", "selective"]
RECOMPUTES: tuple[str, ...] = ("full", "selective")
Choice = Literal["none", "selective", "full"]

#: Ops whose outputs selective recomputation keeps (``namespace.op`` packets: every overload; or one
#: overload as ``namespace.op.overload``): matmuls, convolutions and fused attention kernels. Ops the
#: running torch build does not have are skipped when they come from this default.
DEFAULT_SAVE_OPS: tuple[str, ...] = (
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.baddbmm",
    "aten.convolution",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
)


@dataclass(frozen=True)
class BlockRecord:
    """One module of the model, as the policy sees it.

    ``saved_bytes``: bytes its forward saves for backward, excluding its own inputs and parameters
    (what recomputing it frees). ``input_bytes``: bytes of its tensor inputs that something saves
    (freed too when it is recomputed inside a segment, not at a segment's head).
    ``forward_seconds``: measured forward time of its ops (the cost of recomputing it whole).
    ``selective_bytes``: bytes selective recomputation still keeps (outputs of the saved ops, its own
    inputs excluded). ``selective_seconds``: measured forward time of the ops it reruns.
    """

    name: str
    class_paths: tuple[str, ...]
    container: str = ""
    sequential: bool = False
    position: int = 0
    params: int = 0
    saved_bytes: Optional[int] = None
    input_bytes: Optional[int] = None
    forward_seconds: Optional[float] = None
    selective_bytes: Optional[int] = None
    selective_seconds: Optional[float] = None


@dataclass(frozen=True)
class BlockSelection:
    """What the user asked for; validated at construction, every problem reported at once."""

    classes: tuple[str, ...] = ()
    pattern: Optional[str] = None
    mode: Mode = "all"
    every: Optional[int] = None
    budget_bytes: Optional[int] = None
    recompute: Recompute = "full"
    save_ops: tuple[str, ...] = DEFAULT_SAVE_OPS

    def __post_init__(self) -> None:
        problems = _selection_problems(self)
        if problems:
            raise ConfigurationError(OWNER, problems)

    @property
    def needs_measurement(self) -> bool:
        return self.mode == "budget"

    @property
    def selective(self) -> bool:
        return self.recompute == "selective"

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
    if sel.recompute not in RECOMPUTES:
        problems.append(f"recompute={sel.recompute!r} is unknown; use one of {list(RECOMPUTES)}")
    if sel.recompute == "selective" and not sel.save_ops:
        problems.append(
            "recompute='selective' with save_ops=[] keeps nothing: use recompute='full' or name ops to keep"
        )
    bad_ops = [op for op in sel.save_ops if not isinstance(op, str) or op.count(".") not in (1, 2)]
    if bad_ops:
        problems.append(f"save_ops={bad_ops!r}: name ops as 'namespace.op' or 'namespace.op.overload' (e.g. 'aten.mm')")
    return problems


@dataclass(frozen=True)
class BlockEstimate:
    """One candidate block in a plan: how it is recomputed and what that is expected to cost.

    ``kept_bytes``: bytes of its internals kept for backward under that choice (``None``: not
    measured). ``recompute_seconds``: forward time rerun in backward (``None``: not measured).
    """

    name: str
    recompute: Choice
    kept_bytes: Optional[int] = None
    recompute_seconds: Optional[float] = None


@dataclass(frozen=True)
class CheckpointPlan:
    """The decision: units to recompute (each a tuple of consecutive block names), and estimates.

    ``units`` are recomputed whole; ``selective`` units keep the outputs of ``save_ops`` and rerun
    the rest. ``bytes_before``/``bytes_after``: estimated saved-activation bytes kept at the end of
    forward without and with the plan (``None`` when not measured). ``extra_forward``: the fraction
    of one forward pass rerun in backward: measured op times when every candidate was timed, else
    the parameter share of the fully recomputed blocks. ``peak_recompute_bytes``: the largest
    unit's internals, alive only while it is recomputed. ``rows``: one estimate per candidate block.
    """

    mode: str
    units: tuple[tuple[str, ...], ...]
    candidates: int
    extra_forward: float
    bytes_before: Optional[int] = None
    bytes_after: Optional[int] = None
    peak_recompute_bytes: Optional[int] = None
    notes: tuple[str, ...] = field(default=())
    selective: tuple[tuple[str, ...], ...] = field(default=())
    save_ops: tuple[str, ...] = field(default=())
    rows: tuple[BlockEstimate, ...] = field(default=())

    @property
    def blocks(self) -> tuple[str, ...]:
        """Every recomputed block (whole or selectively), in model order when ``rows`` give it."""
        names = [name for unit in (*self.units, *self.selective) for name in unit]
        order = {r.name: i for i, r in enumerate(self.rows)}
        return tuple(sorted(names, key=lambda n: order.get(n, len(order)))) if order else tuple(names)

    def describe(self) -> str:
        n_units = len(self.units) + len(self.selective)
        head = f"activation checkpointing ({self.mode}): {n_units} unit(s) over {len(self.blocks)} of {self.candidates} candidate block(s)"
        if self.selective:
            head += f", {len(self.selective)} recomputed selectively (keeping the outputs of {len(self.save_ops)} op kind(s))"
        lines = [head]
        if self.bytes_before is not None and self.bytes_after is not None:
            saved = self.bytes_before - self.bytes_after
            lines.append(
                f"  saved activations: {_fmt_bytes(self.bytes_before)} -> {_fmt_bytes(self.bytes_after)} (estimated {_fmt_bytes(saved)} saved;"
                f" + up to {_fmt_bytes(self.peak_recompute_bytes or 0)} while one unit is recomputed)"
            )
        timed = bool(self.rows) and all(r.recompute_seconds is not None for r in self.rows)
        basis = "measured op times" if timed else "parameter share"
        lines.append(f"  extra compute: about {self.extra_forward:.2f} of one forward pass ({basis})")
        lines.extend(f"  unit {i}: {_fmt_unit(unit)}" for i, unit in enumerate(self.units))
        lines.extend(
            f"  unit {i}: {_fmt_unit(unit)} (selective)" for i, unit in enumerate(self.selective, len(self.units))
        )
        if self.rows and any(r.kept_bytes is not None for r in self.rows):
            lines.extend(_table(self.rows))
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def _table(rows: Sequence[BlockEstimate]) -> list[str]:
    width = max(len("block"), *(len(r.name) for r in rows))
    timed = any(r.recompute_seconds for r in rows)  # untimed plans leave the column out
    out = [f"  {'block':<{width}}  {'recompute':<9}  {'kept':>10}" + (f"  {'recompute ms':>12}" if timed else "")]
    for r in rows:
        kept = _fmt_bytes(r.kept_bytes) if r.kept_bytes is not None else "?"
        ms = f"{r.recompute_seconds * 1e3:.2f}" if r.recompute_seconds is not None else "?"
        out.append(f"  {r.name:<{width}}  {r.recompute:<9}  {kept:>10}" + (f"  {ms:>12}" if timed else ""))
    return out


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
    if selection.needs_measurement:
        missing = _unmeasured(candidates, selection, total_bytes)
        if missing:
            raise ConfigurationError(OWNER, [f"select='budget' needs measured {missing} for every candidate block"])
    notes: tuple[str, ...] = ()
    segments = _sqrt_units(candidates) if selection.mode == "sqrt" else tuple((c.name,) for c in candidates)
    if selection.mode == "budget":
        choices, notes = _budget_choices(candidates, total_bytes or 0, selection)
    else:
        step = selection.every if selection.mode == "every" else 1
        chosen = (
            {c.name for c in candidates[:: step or 1]} if selection.mode != "sqrt" else {c.name for c in candidates}
        )
        choices = _uniform(candidates, chosen, selection.recompute)
    full = tuple(u for u in segments if choices[u[0]] == "full")
    sel = tuple(u for u in segments if choices[u[0]] == "selective")
    return _estimate(selection, candidates, records, (full, sel), choices, total_bytes, notes)


def _unmeasured(candidates: Sequence[BlockRecord], selection: BlockSelection, total: Optional[int]) -> str:
    if total is None or any(c.saved_bytes is None for c in candidates):
        return "saved bytes"
    if selection.selective and any(
        None in (c.forward_seconds, c.selective_bytes, c.selective_seconds) for c in candidates
    ):
        return "forward times and selective bytes (recompute='selective')"
    return ""


def _uniform(candidates: Sequence[BlockRecord], chosen: set[str], recompute: Recompute) -> dict[str, Choice]:
    return {c.name: (recompute if c.name in chosen else "none") for c in candidates}


_FRONTIER = 1024


@dataclass(frozen=True)
class _Option:
    choice: Choice
    freed: int
    cost: float


def _options(c: BlockRecord, selective: bool, timed: bool) -> list[_Option]:
    saved = c.saved_bytes or 0
    options = [_Option("none", 0, 0.0), _Option("full", saved, (c.forward_seconds or 0.0) if timed else 1.0)]
    if selective:
        options.append(_Option("selective", saved - (c.selective_bytes or 0), c.selective_seconds or 0.0))
    return options


def _budget_choices(
    candidates: list[BlockRecord], total: int, selection: BlockSelection
) -> tuple[dict[str, Choice], tuple[str, ...]]:
    budget = selection.budget_bytes or 0
    timed = all(c.forward_seconds is not None for c in candidates)
    per_block = [_options(c, selection.selective, timed) for c in candidates]
    needed = total - budget
    best = _cheapest_combination(per_block, needed)
    if best is None:
        remaining = total - sum(max(o.freed for o in opts) for opts in per_block)
        raise ConfigurationError(
            OWNER,
            [
                f"budget={budget} bytes cannot be met: recomputing all {len(candidates)} candidate blocks still keeps"
                f" about {remaining} bytes ({_fmt_bytes(remaining)}); raise the budget to >= {remaining},"
                " choose more blocks, or use a smaller batch"
            ],
        )
    choices = {c.name: o.choice for c, o in zip(candidates, best, strict=True)}
    notes = ("the model already fits the budget; nothing is recomputed",) if needed <= 0 else ()
    return choices, notes


def _cheapest_combination(per_block: Sequence[Sequence[_Option]], needed: int) -> Optional[list[_Option]]:
    """One option per block freeing at least ``needed`` bytes at the least total cost (``None``: impossible).

    Walks the blocks keeping the Pareto frontier of (cost, bytes freed), with bytes freed capped at
    ``needed`` (freeing more than needed is worth nothing). Ties: more bytes freed, then fewer
    recomputed blocks. Exact while the frontier has at most ``_FRONTIER`` points (always so for
    repeated identical blocks: one point per count of full and selective blocks); beyond that, the
    cheapest point per ``needed / _FRONTIER`` bytes is kept, so the cost is optimal to within that
    resolution of bytes freed while every answer still frees the bytes needed.
    """
    need = max(needed, 0)
    grain = max(1, need // _FRONTIER)
    # A point: (cost, bytes freed, recomputed blocks, its last option, the point it extends).
    frontier: list[tuple[float, int, int, Optional[_Option], Any]] = [(0.0, 0, 0, None, None)]
    for options in per_block:
        merged = [
            (point[0] + o.cost, min(point[1] + o.freed, need), point[2] + (o.choice != "none"), o, point)
            for point in frontier
            for o in options
        ]
        merged.sort(key=lambda p: (p[0], -p[1], p[2]))
        frontier, most, buckets = [], -1, set()
        for point in merged:
            bucket = point[1] // grain if len(merged) > _FRONTIER else point[1]
            if point[1] > most and (bucket not in buckets or point[1] == need):
                frontier.append(point)
                most = point[1]
                buckets.add(bucket)
    best = next((p for p in frontier if p[1] >= need), None)
    picks: list[_Option] = []
    while best is not None and best[3] is not None:
        picks.append(best[3])
        best = best[4]
    return picks[::-1] if best is not None else None


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
    selection: BlockSelection,
    candidates: list[BlockRecord],
    records: Sequence[BlockRecord],
    units: tuple[tuple[tuple[str, ...], ...], tuple[tuple[str, ...], ...]],
    choices: dict[str, Choice],
    total: Optional[int],
    notes: tuple[str, ...],
) -> CheckpointPlan:
    full, sel = units
    rows = tuple(_row(c, choices[c.name]) for c in candidates)
    root = next((r for r in records if r.name == ""), None)
    if root is not None and root.forward_seconds and all(r.recompute_seconds is not None for r in rows):
        extra = sum(r.recompute_seconds or 0.0 for r in rows) / root.forward_seconds
    else:
        by_name = {c.name: c for c in candidates}
        root_params = max((r.params for r in records), default=0) or 1  # the root holds every parameter
        extra = sum(by_name[n].params for unit in full for n in unit) / root_params
        if sel:
            notes = (*notes, "selective recompute time not measured (no example_input_array): not in extra compute")
    before = after = peak = None
    if total is not None and all(c.saved_bytes is not None for c in candidates):
        freed = [_freed(candidates, unit, selective=False) for unit in full]
        freed += [_freed(candidates, unit, selective=True) for unit in sel]
        before, after, peak = total, total - sum(f for f, _ in freed), max((p for _, p in freed), default=0)
    return CheckpointPlan(
        selection.mode,
        full,
        len(candidates),
        extra,
        before,
        after,
        peak,
        notes,
        sel,
        selection.save_ops if sel else (),
        rows,
    )


def _row(c: BlockRecord, choice: Choice) -> BlockEstimate:
    if choice == "none":
        return BlockEstimate(c.name, choice, c.saved_bytes, 0.0)
    if choice == "full":
        return BlockEstimate(c.name, choice, 0 if c.saved_bytes is not None else None, c.forward_seconds)
    return BlockEstimate(c.name, choice, c.selective_bytes, c.selective_seconds)


def _freed(candidates: list[BlockRecord], unit: tuple[str, ...], selective: bool) -> tuple[int, int]:
    """(bytes the unit frees at the end of forward, bytes alive while it is recomputed)."""
    by_name = {c.name: c for c in candidates}
    internals = sum((by_name[n].saved_bytes or 0) + (by_name[n].input_bytes or 0) * (j > 0) for j, n in enumerate(unit))
    kept = sum(by_name[n].selective_bytes or 0 for n in unit) if selective else 0
    return internals - kept, internals - kept


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
