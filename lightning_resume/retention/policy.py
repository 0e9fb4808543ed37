"""What to keep: a pure retention policy over checkpoint records.

This module owns the retention rules (rolling ``keep_last``, best-by-metric ``keep_best``, permanent
anchors by step and by wall time) and the protections that no setting overrides. It decides from
plain records and explains every decision; it must not import Lightning, touch files or read the
clock. Saves are ordered by training progress (step, then save counter), never by wall time.
``RetentionCheckpoint`` and ``lightning-resume prune`` both call it, so the rules live here only.

Anchors, precisely: with ``anchor_every_n_steps=K`` the anchor of step interval ``[k*K, (k+1)*K)``
(for ``k >= 1``) is the eligible record with the smallest ``(step, seq, path)`` in that interval;
with ``anchor_every=T`` seconds the anchor of wall-time interval ``[k*T, (k+1)*T)`` (counted from the
Unix epoch, so the grid never moves) is the eligible record with the smallest ``(time, step, path)``.
An interval that already holds a record tagged ``"anchor"`` gets no other anchor, and a record tagged
``"anchor"`` is always kept, so an anchor once chosen (and tagged by the caller) stays an anchor
however the history grows.
"""

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal, NamedTuple, Optional, Sequence, cast

from lightning_resume.durations import Duration, parse_duration
from lightning_resume.errors import ConfigurationError, TreeFormatError

ANCHOR = "anchor"
GROUP = "retention."
"""How problems name the policy's options: as ``RetentionCheckpoint``'s group ``retention`` holds them."""

_RECORD_TYPES: dict = {
    "path": (str,),
    "step": (int,),
    "epoch": (int,),
    "time": (int, float),
    "metric": (int, float, type(None)),
    "tags": (list, tuple, set, frozenset),
    "verified": (bool,),
    "in_flight": (bool,),
    "owned": (bool,),
    "seq": (int,),
}
"""The fields of a saved ``CheckpointRecord`` and the types each may hold in a file."""


@dataclass(frozen=True)
class CheckpointRecord:
    """One checkpoint on disk (or being written), as retention sees it.

    ``owned``: proven written by this callback's run (its own record, carried in its state, names it
    and the run); a name alone proves nothing, and anything not owned is never deleted. ``verified``:
    the file was complete and checked when recorded. ``in_flight``: a save that has not returned yet.
    ``seq``: the run's save counter, which orders saves of the same step; ``time`` (wall clock) is
    used only by time anchors, never to order saves.
    """

    path: str
    step: int
    epoch: int = 0
    time: float = 0.0
    metric: Optional[float] = None
    tags: frozenset = field(default_factory=frozenset)
    verified: bool = True
    in_flight: bool = False
    owned: bool = True
    seq: int = 0

    def to_state(self) -> dict:
        """Plain types only, so a checkpoint holding it loads with ``torch.load(weights_only=True)``."""
        return {
            "path": self.path,
            "step": self.step,
            "epoch": self.epoch,
            "time": self.time,
            "metric": self.metric,
            "tags": sorted(self.tags),
            "verified": self.verified,
            "in_flight": self.in_flight,
            "owned": self.owned,
            "seq": self.seq,
        }

    @classmethod
    def from_state(cls, state: dict) -> "CheckpointRecord":
        """Inverse of :meth:`to_state`. Fields a newer version added are ignored (forward compatible);
        a known field of the wrong type raises ``TreeFormatError`` naming it."""
        if not isinstance(state, dict):
            raise TreeFormatError(f"retention record is not a dict: {type(state).__name__}")
        known = {k: v for k, v in state.items() if k in _RECORD_TYPES}
        if "path" not in known or "step" not in known:
            raise TreeFormatError(f"retention record lacks 'path' or 'step': {sorted(map(str, state))}")
        for name, value in known.items():
            types = _RECORD_TYPES[name]
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                raise TreeFormatError(f"retention record field {name!r} has type {type(value).__name__}")
        tags = known.get("tags", ())
        if not all(isinstance(t, str) for t in tags):
            raise TreeFormatError("retention record field 'tags' holds a non-string")
        return cls(**{**known, "tags": frozenset(tags)})

    @property
    def recency(self) -> tuple:
        """Total order of saves, oldest first, by training progress: global step, then the save
        counter, then path (for ties). Never wall time: a clock that steps back (NTP, another node)
        would make a new save look old."""
        return (self.step, self.seq, self.path)

    @property
    def wall_order(self) -> tuple:
        """Order for time anchors only: wall time, then step, then path."""
        return (self.time, self.step, self.path)


class KeepDecision(NamedTuple):
    """Keep or delete ``record``, and why (one short phrase per rule or protection that applied)."""

    record: CheckpointRecord
    keep: bool
    reasons: tuple


class _Context(NamedTuple):
    resume_source: Optional[str]
    newest_verified: Optional[str]


# Protections: one named predicate each; no policy setting can override them.
def is_resume_source(record: CheckpointRecord, ctx: _Context) -> bool:
    return ctx.resume_source is not None and record.path == ctx.resume_source


def is_newest_verified(record: CheckpointRecord, ctx: _Context) -> bool:
    return record.path == ctx.newest_verified


def is_in_flight(record: CheckpointRecord, ctx: _Context) -> bool:
    return record.in_flight


def is_not_owned(record: CheckpointRecord, ctx: _Context) -> bool:
    return not record.owned


def is_unverified(record: CheckpointRecord, ctx: _Context) -> bool:
    # A file that does not verify may be damaged, or of a format this version cannot read: deleting
    # it on that evidence could destroy the only copy. It is reported and left to a person.
    return not record.verified and not record.in_flight


PROTECTIONS: tuple = (
    ("protected: resume source of this run", is_resume_source),
    ("protected: newest verified checkpoint", is_newest_verified),
    ("protected: save still in flight", is_in_flight),
    ("protected: not created by this callback", is_not_owned),
    ("protected: does not verify (kept for inspection; delete it by hand)", is_unverified),
)


def newest_verified_record(records: Iterable[CheckpointRecord]) -> Optional[CheckpointRecord]:
    """The most recent complete, verified checkpoint, or ``None``."""
    done = [r for r in records if r.verified and not r.in_flight]
    return max(done, key=lambda r: r.recency) if done else None


def _is_eligible(record: CheckpointRecord) -> bool:
    """Records the keep rules may choose: ours, complete and verified."""
    return record.owned and record.verified and not record.in_flight


def _usable_metric(value: Optional[float]) -> bool:
    return value is not None and not math.isnan(value)


def policy_problems(
    keep_last: Optional[int],
    keep_best: Optional[int],
    mode: Optional[str],
    anchor_every_n_steps: Optional[int],
    anchor_every: Optional[float],
) -> list:
    """Every problem with these settings, each naming the option (``retention.<option>``), the value and the fix."""
    group, problems = GROUP, []
    if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
        problems.append(
            f"{group}keep_last={keep_last!r} would delete the checkpoint being written; use >= 1 (None turns it off)"
        )
    if keep_best is not None and (type(keep_best) is not int or keep_best < 1):
        problems.append(f"{group}keep_best={keep_best!r} keeps no best checkpoint; use >= 1 (None turns it off)")
    if mode not in (None, "min", "max"):
        problems.append(f"{group}mode={mode!r} is not a direction; use 'min' or 'max'")
    if anchor_every_n_steps is not None and (type(anchor_every_n_steps) is not int or anchor_every_n_steps < 1):
        problems.append(
            f"{group}anchor_every_n_steps={anchor_every_n_steps!r} is not a step interval; use >= 1 (None turns it off)"
        )
    if anchor_every is not None and not anchor_every > 0:
        problems.append(
            f"{group}anchor_every={anchor_every} seconds is not an interval; use a positive duration such as '6h'"
        )
    return problems


@dataclass(frozen=True)
class RetentionPolicy:
    """What to keep: the union of the rules below, plus the protections no setting overrides.

    ``keep_last``: the N most recent. ``keep_best``: the N best by the metric, in direction ``mode``.
    ``anchor_every_n_steps``: permanently, the first checkpoint of each step interval. ``anchor_every``:
    permanently, the first of each wall-time interval, given as seconds, a ``timedelta`` or a string such
    as ``"6h"`` (held as seconds once built). ``None`` turns a rule off; with every rule off the policy is
    inactive and keeps everything. ``mode=None`` means ``"min"`` here; ``RetentionCheckpoint`` gives the
    policy its own ``mode``, so set the direction there. Invalid values raise ``ConfigurationError``
    naming each as ``retention.<option>``, the name of this group in ``RetentionCheckpoint``.
    """

    keep_last: Optional[int] = None
    keep_best: Optional[int] = None
    mode: Optional[Literal["min", "max"]] = None
    anchor_every_n_steps: Optional[int] = None
    anchor_every: Optional[Duration] = None

    def __post_init__(self) -> None:
        seconds, unparsed = None, []
        if self.anchor_every is not None:
            try:
                seconds = parse_duration(self.anchor_every, f"{GROUP}anchor_every")
            except ValueError as err:
                unparsed.append(str(err))
        problems = policy_problems(self.keep_last, self.keep_best, self.mode, self.anchor_every_n_steps, seconds)
        problems += unparsed
        if problems:
            raise ConfigurationError("RetentionPolicy", problems)
        object.__setattr__(self, "anchor_every", seconds)  # one unit once built: equal policies compare equal

    @property
    def anchor_seconds(self) -> Optional[float]:
        """``anchor_every`` in seconds (``__post_init__`` converted it), or ``None``."""
        return cast(Optional[float], self.anchor_every)

    @property
    def direction(self) -> Literal["min", "max"]:
        """The metric's direction for ``keep_best``: ``mode``, or ``"min"`` when unset."""
        return self.mode or "min"

    @property
    def active(self) -> bool:
        rules = (self.keep_last, self.keep_best, self.anchor_every_n_steps, self.anchor_every)
        return any(rule is not None for rule in rules)

    def decide(self, records: Sequence[CheckpointRecord], resume_source: Optional[str] = None) -> list:
        """One ``KeepDecision`` per record, oldest first. Deterministic: depends only on the arguments."""
        ordered = sorted(records, key=lambda r: r.recency)
        if not self.active:
            return [KeepDecision(r, True, ("retention off: no keep rule set",)) for r in ordered]
        newest = newest_verified_record(ordered)
        ctx = _Context(resume_source, newest.path if newest else None)
        kept = self._kept_by_rules(ordered)
        decisions = []
        for record in ordered:
            reasons = [name for name, applies in PROTECTIONS if applies(record, ctx)]
            reasons += kept.get(record.path, [])
            if not reasons:
                reasons = [self._why_not(record)]
                decisions.append(KeepDecision(record, False, tuple(reasons)))
            else:
                decisions.append(KeepDecision(record, True, tuple(reasons)))
        return decisions

    def anchors(self, records: Sequence[CheckpointRecord]) -> list:
        """Records that are anchors: tagged ones, plus the chosen record of each untagged interval."""
        eligible = [r for r in records if _is_eligible(r)]
        chosen = {r.path: r for r in records if ANCHOR in r.tags}
        if self.anchor_every_n_steps is not None:
            k = self.anchor_every_n_steps
            chosen.update(_pick_per_interval(eligible, lambda r: r.step // k, lambda r: r.recency, 1))
        if self.anchor_seconds is not None:
            t = self.anchor_seconds
            chosen.update(_pick_per_interval(eligible, lambda r: math.floor(r.time / t), lambda r: r.wall_order, None))
        return sorted(chosen.values(), key=lambda r: r.recency)

    def _kept_by_rules(self, ordered: Sequence[CheckpointRecord]) -> dict:
        kept: dict = {}
        eligible = [r for r in ordered if _is_eligible(r)]
        if self.keep_last is not None:
            for r in eligible[-self.keep_last :]:
                kept.setdefault(r.path, []).append(f"rolling: among the {self.keep_last} most recent")
        if self.keep_best is not None:
            for r in self._best(eligible):
                kept.setdefault(r.path, []).append(f"best: among the {self.keep_best} best ({self.direction} metric)")
        for r in self.anchors(ordered):
            kept.setdefault(r.path, []).append("anchor: kept permanently")
        return kept

    def _best(self, eligible: Sequence[CheckpointRecord]) -> list:
        return self.ranked_by_metric(eligible)[: self.keep_best]

    def ranked_by_metric(self, records: Sequence[CheckpointRecord]) -> list:
        """Records with a usable (not None, not NaN) metric, best first; ties: the earlier one first."""
        scored = [r for r in records if _usable_metric(r.metric)]
        sign = 1.0 if self.direction == "min" else -1.0
        return sorted(scored, key=lambda r: (sign * r.metric, r.recency))

    def _why_not(self, record: CheckpointRecord) -> str:
        rules = []
        if self.keep_last is not None:
            rules.append(f"older than the {self.keep_last} most recent")
        if self.keep_best is not None:
            rules.append(f"not among the {self.keep_best} best" if _usable_metric(record.metric) else "no metric")
        if self.anchor_every_n_steps is not None or self.anchor_every is not None:
            rules.append("not an anchor")
        return "delete: " + "; ".join(rules)


def _pick_per_interval(
    eligible: Sequence[CheckpointRecord],
    interval: Callable[[CheckpointRecord], int],
    order: Callable[[CheckpointRecord], tuple],
    first_interval: Optional[int],
) -> dict:
    """For each interval with no tagged anchor yet, the record first in ``order``."""
    tagged = {interval(r) for r in eligible if ANCHOR in r.tags}
    best: dict = {}
    for r in eligible:
        i = interval(r)
        if i in tagged or (first_interval is not None and i < first_interval):
            continue
        if i not in best or order(r) < order(best[i]):
            best[i] = r
    return {r.path: r for r in best.values()}
