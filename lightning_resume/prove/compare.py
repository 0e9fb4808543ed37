"""The verdict of ``lightning-resume prove``: run B (killed and relaunched) compared with run A (uninterrupted).

This module owns the comparison rule of ``docs/prove.md``: reading the trace files (``read_trace``, its only
file access, through ``prove.files``' bounded readers), cutting B's launches where the next one resumed
(``_cut``), finding the first record that differs on any rank (``compare``), with saves and files whose
steps the clock chose (snapshots) compared by content where both runs have them, not by presence; naming the cause and fix from the component
that first differed and the evidence recorded (the ``findings`` of that launch's start, each with a kind,
and the loaders and schedulers it trained with), saying "not sure" where that evidence does not single one
out; and showing the verdict (``render``, ``to_json``). It is pure over plain records: no processes, no
torch, no Lightning, no clock; starting, killing and relaunching the runs is ``prove.runner``'s, writing the
trace ``prove.trace``'s.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Optional, Sequence, Union

from lightning_resume.errors import LightningResumeError
from lightning_resume.prove import files
from lightning_resume.prove import findings as kinds
from lightning_resume.prove.findings import Finding, from_records, of_kind

Record = Mapping[str, Any]
Trace = Mapping[int, Sequence[Record]]

Component = Literal[
    "start", "batch", "rng", "loss", "lr", "params", "optim", "val", "sched", "user", "files", "missing", "extra"
]  # fmt: skip

COMPARED_KINDS = ("batch", "state", "saved", "val", "end")
"""The record kinds compared; ``start`` records only delimit launches and carry their ``problems``, and a
kind this version does not know (a newer trace writer) is left out of the comparison."""

IGNORED_FIELDS = frozenset({"kind", "time", "pid", "timed", "timed_files", "retention_files"})
"""Fields that differ between any two runs (``kind`` is compared before the fields), and the facts about
timing that decide what is compared (a ``saved`` record's ``timed``, ``end``'s ``timed_files`` and
``retention_files``): read by ``_by_timing``, not compared."""

FIELD_COMPONENTS: Mapping[str, Sequence[tuple[str, Component]]] = {
    "batch": (
        ("step", "batch"), ("epoch", "batch"), ("micro", "batch"), ("rng", "rng"), ("sched", "sched"),
        ("user", "user"), ("batch", "batch"), ("loss", "loss"), ("lr", "lr"), ("logged", "val"),
    ),
    "state": (("step", "missing"), ("params", "params"), ("optim", "optim")),
    "saved": (("step", "missing"), ("params", "params"), ("optim", "optim")),
    "val": (("step", "val"), ("metrics", "val")),
    "end": (
        ("step", "missing"), ("params", "params"), ("optim", "optim"), ("sched", "sched"), ("metrics", "val"),
        ("files", "files"),
    ),
}  # fmt: skip
"""Per kind, its fields in the order they are compared and the component a difference in each is reported as.
The order is causal: a batch's position before the RNG streams it started with (a loader restarted on a new
iterator also draws from them), then the state the step starts from (the schedulers Lightning saves, the
state ExactResume captures beyond them, by name), before the batch it may shape and the loss it produces.
A field not listed (a newer trace writer) is compared after these and reported as ``OTHER_FIELDS[kind]``.
A ``missing`` step on a non-batch record becomes ``extra`` when B's step is the later one."""

OTHER_FIELDS: Mapping[str, Component] = {"batch": "batch", "state": "params", "saved": "params", "val": "val"}

NO_RELAUNCH = "no relaunch happened: the run was never killed after a checkpoint"

TRACE_FILE = re.compile(r"trace-rank(\d+)\.jsonl")


class TraceFormatError(LightningResumeError, ValueError):
    """A trace line that is not a JSON record, where no SIGKILL can have cut it."""

    def __init__(self, path: Union[str, Path], line: int, text: str) -> None:
        self.path, self.line, self.text = str(path), line, text
        shown = text if len(text) <= 80 else text[:77] + "..."
        super().__init__(f"{self.path}:{line}: not a trace record (a JSON object with a 'kind'): {shown!r}")


# ------------------------------------------------------------------------------------------- reading


def read_trace(directory: Union[str, Path]) -> dict[int, list[dict[str, Any]]]:
    """Every ``trace-rank<R>.jsonl`` in ``directory``: ``{rank: records in file order}``, ranks sorted.

    A missing directory reads as no trace (``{}``): nothing was recorded. A line a SIGKILL cut is skipped,
    any other line that is not a record raises ``TraceFormatError`` naming the file and line. Each file is
    read without following a link or blocking, as a regular file, line by line with a bound on each
    (``prove.files``): a FIFO, a link or a line longer than ``files.MAX_RECORD`` raises
    ``files.UnsafeRunFile`` naming it."""
    root = Path(directory)
    if root.is_symlink():
        raise files.UnsafeRunFile(str(root), "is a symbolic link, not the trace directory the run was given")
    if not root.is_dir():
        return {}
    found = {int(m.group(1)): path for path in root.iterdir() if (m := TRACE_FILE.fullmatch(path.name))}
    return {rank: _read_file(found[rank]) for rank in sorted(found)}


def _read_file(path: Path) -> list[dict[str, Any]]:
    """The records of one file. A SIGKILL can cut the line being written: the last line of the file, or,
    since every launch appends to the same file, the line just before a relaunch's ``start`` record (the
    writer starts each launch on a new line). Those lines are skipped; a bad line anywhere else is an error,
    since dropping it would hide a record from the comparison."""
    lines = [line.decode("utf-8", errors="replace") for line in files.read_lines(str(path))]
    parsed = [_parse(line) for line in lines]
    records = []
    for number, record in enumerate(parsed, 1):
        if record is not None:
            records.append(record)
            continue
        torn = number == len(parsed) or (parsed[number] or {}).get("kind") == "start"
        if not torn:
            raise TraceFormatError(path, number, lines[number - 1])
    return records


def _parse(line: str) -> Optional[dict[str, Any]]:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("kind"), str) else None


# ---------------------------------------------------------------------------------- cutting launches


@dataclass(frozen=True)
class _Problem:
    """A relaunch that cannot be exact, found in the start records alone."""

    position: int  # index in the effective records where the relaunch's own records begin
    launch: int
    step: int
    cause: str
    fix: str
    expected: Any
    got: Any


@dataclass(frozen=True)
class _Cut:
    """One rank of B after the cut rule: the compared records, each with the launch (1-based) it came from."""

    records: tuple[Record, ...] = ()
    origins: tuple[int, ...] = ()
    starts: tuple[Record, ...] = ()  # one per launch ({} for records before any start record)
    resumed_at: tuple[int, ...] = ()  # the start step of each relaunch (launch 2 on)
    restores: Mapping[int, int] = field(default_factory=dict)  # launch -> index where its own records begin
    problems: tuple[_Problem, ...] = ()
    timed: tuple[tuple[int, Record], ...] = ()  # saves at timed steps, each with where it stood (``_dropping``)


FRESH_FIX = 'resume from the newest checkpoint at every launch: pass ckpt_path="last" to trainer.fit (or --ckpt_path last with LightningCLI)'
STALE_FIX = (
    'give the run a checkpoint directory of its own, empty at its first launch, and resume with ckpt_path="last"'
)


def _cut(records: Sequence[Record]) -> _Cut:
    """B's records of one rank as one uninterrupted history, and the problems its relaunches show.

    Each relaunch keeps what came before it up to and including the last ``saved`` record of the step it
    resumed at (a validation between two saves of that step, and the later save, are kept: ``"last"`` is the
    newer one), then its own records; what a killed process did after that checkpoint was lost and redone.
    Only the compared kinds are kept (no ``start``). Problems: a relaunch that loaded no checkpoint
    after one was saved (it starts the history over), and a launch that resumed at a step the history it
    continues never saved (cut before the first record past that step)."""
    kept: list[tuple[Record, int]] = []
    starts, resumed_at = [], []
    problems: list[_Problem] = []
    restores: dict[int, int] = {}
    saved_before: list[int] = []  # steps saved by earlier launches, cut or not
    for n, (start, body) in enumerate(_launches(records), 1):
        starts.append(start)
        if n > 1 or start.get("resumed_from") is not None:
            kept, problem = _resume(kept, start, n, saved_before, body)
            # a problem whose records this resume dropped now shows where the kept history ends
            problems = [replace(p, position=min(p.position, len(kept))) for p in problems]
            problems += [problem] if problem is not None else []
        if n > 1:
            resumed_at.append(int(start.get("step") or 0))
            restores[n] = len(kept)
        for record in body:
            if _compared(kept[-1][0] if kept and kept[-1][1] == n else None, record):  # within one launch
                kept.append((record, n))
        saved_before += [int(r.get("step") or 0) for r in body if r.get("kind") == "saved"]
    return _Cut(
        records=tuple(r for r, _ in kept), origins=tuple(n for _, n in kept), starts=tuple(starts),
        resumed_at=tuple(resumed_at), restores=restores, problems=tuple(problems),
    )  # fmt: skip


def _launches(records: Sequence[Record]) -> list[tuple[Record, list[Record]]]:
    """``(start record, the records after it)`` per launch; records before any start form a launch of
    their own with an empty start."""
    launches: list[tuple[Record, list[Record]]] = []
    for record in records:
        if record.get("kind") == "start":
            launches.append((record, []))
        elif launches:
            launches[-1][1].append(record)
        else:
            launches.append(({}, [record]))
    return launches


def _resume(
    kept: list[tuple[Record, int]], start: Record, n: int, saved_before: Sequence[int], body: Sequence[Record] = ()
) -> tuple[list[tuple[Record, int]], Optional[_Problem]]:
    """The history launch ``n`` continues, and the problem with its start, if any. A relaunch that begins by
    running a validation of the step it resumed at resumed a checkpoint saved before that validation (one
    saved when it was due): the history is cut at the last save of the step before it."""
    step, source = int(start.get("step") or 0), start.get("resumed_from")
    if source is None:  # a fresh start redoes everything: the history starts over
        if not saved_before:
            return [], None
        cause = (
            f"the relaunch (launch {n}) loaded no checkpoint and started from step {step}, although the checkpoint"
            f" of step {saved_before[-1]} had been saved (its start record has resumed_from null)"
        )
        return [], _Problem(0, n, step, cause, FRESH_FIX, saved_before[-1], step)
    hits = [i for i, (r, _) in enumerate(kept) if r.get("kind") == "saved" and r.get("step") == step]
    first = next((r for r in body if r.get("kind") in COMPARED_KINDS and r.get("kind") != "saved"), {})
    if first.get("kind") == "val" and first.get("step") == step:  # the validation was due at the save
        vals = [i for i, (r, _) in enumerate(kept) if r.get("kind") == "val" and r.get("step") == step]
        hits = [i for i in hits if not vals or i < vals[0]] or hits
    if hits:
        return kept[: hits[-1] + 1], None
    kept = kept[: _position_of_step(kept, step)]
    what = (
        "the first launch must start fresh"
        if n == 1
        else "no earlier launch saved that step in the history it continues"
    )
    cause = f"launch {n} resumed at step {step} from {source}, a checkpoint this run did not write ({what})"
    return kept, _Problem(len(kept), n, step, cause, STALE_FIX, sorted(set(saved_before)), step)


def _position_of_step(kept: Sequence[tuple[Record, int]], step: int) -> int:
    """Where step ``step`` begins in ``kept``: before its first batch (whose ``step`` is the one before its
    optimizer step) or the first later record of another kind."""
    for i, (r, _) in enumerate(kept):
        s = int(r.get("step") or 0)
        if s > step or (r.get("kind") == "batch" and s >= step):
            return i
    return len(kept)


# ------------------------------------------------------------------------------------------ comparing


@dataclass(frozen=True)
class Verdict:
    """The outcome of comparing B with A.

    ``exact``: every compared record of every rank is equal (and B relaunched, unless not required). Else
    the first difference: ``step``, ``rank``, ``component`` (and ``detail``: which scheduler, which captured
    state, which metrics), A's value (``expected``) and B's (``got``), and one sentence each of ``cause`` and
    ``fix`` (both empty when exact); ``sure`` is ``False`` when the recorded evidence did not single out one
    cause (the cause then begins with "not sure" and says what was compared). Per rank: ``launches`` and
    ``resumed_at`` (the steps the relaunches resumed at) of B's ranks, and ``compared`` (records compared, up
    to and including the differing one) of every rank A or B has."""

    exact: bool
    step: Optional[int] = None
    rank: Optional[int] = None
    component: Optional[Component] = None
    expected: Any = None
    got: Any = None
    cause: str = ""
    fix: str = ""
    launches: Mapping[int, int] = field(default_factory=dict)
    resumed_at: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    compared: Mapping[int, int] = field(default_factory=dict)
    detail: Optional[str] = None
    sure: bool = True


@dataclass(frozen=True)
class _Finding:
    """The first difference on one rank, with what its diagnosis reads."""

    position: int
    rank: int
    step: Optional[int]
    component: Component
    field: str
    expected: Any
    got: Any
    launch: int = 1  # B's launch the differing record came from (the last one when B has none there)
    start: Record = dataclasses.field(
        default_factory=dict
    )  # that launch's start record: its findings, loaders, schedulers
    after_restore: bool = False  # the first weights B recorded after a relaunch resumed
    last_steps: tuple[Optional[int], Optional[int]] = (None, None)  # A's and B's last recorded steps
    diagnosis: Optional[tuple[str, str]] = None  # cause and fix already known (a start problem)
    detail: Optional[str] = None  # the scheduler index, captured-state name or metric names that differ
    lr_varies: bool = False  # A's learning rates change during its run

    @property
    def findings(self) -> tuple[Finding, ...]:
        return from_records(self.start.get("findings"))


def compare(a: Trace, b: Trace, *, require_relaunch: bool = True, ignore: Sequence[str] = ()) -> Verdict:
    """Compare B's effective records (``_cut``) with A's, record by record, per rank, in order.

    The first difference decides: the lowest position over ranks, the lowest rank on a tie. A relaunch
    problem counts as a difference where that relaunch's records begin. With ``require_relaunch`` (the
    default), a B that never relaunched on some rank is no proof, whatever its records: an uninterrupted B
    shows nothing about resuming. Saves and files whose steps the clock chose are compared as
    ``_by_timing`` says. ``ignore`` names record kinds (``"saved"``) or fields (``"files"``) left out of
    the comparison (the cut rule still reads them): for a caller that checks those itself, e.g. a test of
    training exactness alone; ``prove`` compares everything."""
    timing = _Timing.of(a, b)
    cuts = {rank: _dropping(_cut(records), timing, ignore) for rank, records in b.items()}
    a_timed = {rank: _timed_saves(records, timing, ignore) for rank, records in a.items()}
    a = {rank: _drop_records(records, timing, ignore) for rank, records in a.items()}
    launches = {rank: len(cut.starts) for rank, cut in sorted(cuts.items())}
    resumed_at = {rank: cut.resumed_at for rank, cut in sorted(cuts.items())}
    findings, compared = [], {}
    for rank in sorted(set(a) | set(b)):
        a_rank = _compared_records(a.get(rank, ()))
        cut = _sources_kept(cuts.get(rank, _Cut()), a_rank)
        finding, compared[rank] = _first_finding(rank, a_rank, cut)
        timed = _timed_content_finding(rank, a_timed.get(rank, {}), cut)
        findings += [f for f in (finding, timed) if f is not None]
    summary: dict[str, Any] = {"launches": launches, "resumed_at": resumed_at, "compared": compared}
    lone = [rank for rank, n in launches.items() if n < 2] if launches else [0]
    if require_relaunch and lone:
        fix = "kill it later, once a checkpoint exists: save more often (ModelCheckpoint(every_n_train_steps=...)) or train for more steps"
        return Verdict(False, rank=lone[0], component="start", cause=NO_RELAUNCH, fix=fix, **summary)
    if not findings:
        return Verdict(True, **summary)
    first = min(findings, key=lambda f: (f.position, f.rank))
    cause, fix = first.diagnosis or _diagnose(first)
    return Verdict(
        False, step=first.step, rank=first.rank, component=first.component, expected=first.expected,
        got=first.got, cause=cause, fix=fix, detail=first.detail, sure=not isinstance(cause, Unsure), **summary,
    )  # fmt: skip


@dataclass(frozen=True)
class _Timing:
    """What the clock chose in either run, read from both traces whole (every launch): the steps of ``timed``
    saves (scheduled, preemption and memory-tier snapshots), and the files whose presence depends on them.

    A save at such a step is compared by content where both runs saved that step (``_timed_content_finding``),
    never by position: the other run snapshots at other steps, and a retention that took a snapshot skips its
    own save of the same step. In ``end.files``, the snapshot files of either run (``timed_files``) and, once
    either run took a timed save, the files of a retention that counts snapshots (``retention_files``) are
    left out: which of them exist depends on when the snapshots were taken."""

    steps: frozenset[int] = frozenset()
    files: frozenset[str] = frozenset()

    @classmethod
    def of(cls, a: Trace, b: Trace) -> _Timing:
        every = [r for trace in (a, b) for records in trace.values() for r in records]
        steps = frozenset(int(r.get("step") or 0) for r in every if r.get("kind") == "saved" and r.get("timed"))
        ends = [r for r in every if r.get("kind") == "end"]
        files = {str(n) for r in ends for n in r.get("timed_files") or ()}
        if steps:
            files |= {str(n) for r in ends for n in r.get("retention_files") or ()}
        return cls(steps, frozenset(files))

    def drops(self, record: Record) -> bool:
        return record.get("kind") == "saved" and int(record.get("step") or 0) in self.steps

    def strip(self, record: Record) -> Record:
        if record.get("kind") != "end" or not self.files or not isinstance(record.get("files"), list):
            return record
        return {**record, "files": [name for name in record["files"] if name not in self.files]}


def _drop_records(records: Sequence[Record], timing: _Timing, ignore: Sequence[str]) -> list[Record]:
    """A's records as compared: without saves at timed steps, without timed files, without ``ignore``."""
    return _ignoring([timing.strip(r) for r in records if not timing.drops(r)], ignore)


def _ignoring(records: Sequence[Record], ignore: Sequence[str]) -> list[Record]:
    """``records`` without the kinds in ``ignore`` and without its fields."""
    if not ignore:
        return list(records)
    return [{k: v for k, v in r.items() if k not in ignore} for r in records if r.get("kind") not in ignore]


def _dropping(cut: _Cut, timing: _Timing, ignore: Sequence[str]) -> _Cut:
    """``cut`` as ``_drop_records`` leaves A's records, every position that points into dropped ones moved. The
    saves at timed steps stay in ``timed``, for their comparison by content."""
    timed_dropped = [] if "saved" in ignore else [i for i, r in enumerate(cut.records) if timing.drops(r)]
    dropped = [i for i, r in enumerate(cut.records) if timing.drops(r) or r.get("kind") in ignore]
    if not dropped:
        return replace(cut, records=tuple(_drop_records(cut.records, timing, ignore)))
    kept = [i for i in range(len(cut.records)) if i not in set(dropped)]
    moved = {old: new for new, old in enumerate(kept)}

    def position(old: int) -> int:
        return next((moved[i] for i in range(old, len(cut.records)) if i in moved), len(kept))

    return replace(
        cut,
        records=tuple(_drop_records([cut.records[i] for i in kept], timing, ignore)),
        origins=tuple(cut.origins[i] for i in kept),
        restores={launch: position(i) for launch, i in cut.restores.items()},
        problems=tuple(replace(p, position=position(p.position)) for p in cut.problems),
        timed=tuple((position(i), cut.records[i]) for i in timed_dropped),
    )


def _timed_saves(records: Sequence[Record], timing: _Timing, ignore: Sequence[str]) -> dict[int, Record]:
    """A's first save of each timed step, compared by content with B's (``_timed_content_finding``)."""
    if "saved" in ignore:
        return {}
    return {int(r.get("step") or 0): r for r in reversed(records) if timing.drops(r)}


def _timed_content_finding(rank: int, a_saves: Mapping[int, Record], cut: _Cut) -> Optional[_Finding]:
    """The first timed step both runs saved whose weights or optimizer state differ, placed where B's save of
    it stood among B's compared records."""
    b_saves = {int(r.get("step") or 0): (position, r) for position, r in reversed(cut.timed)}
    for step in sorted(set(b_saves) & set(a_saves)):
        position, b_record = b_saves[step]
        a_record = a_saves[step]
        for name, component in (("params", "params"), ("optim", "optim")):
            if a_record.get(name) != b_record.get(name):
                launch = cut.origins[position] if position < len(cut.origins) else len(cut.starts)
                return _Finding(
                    position, rank, step, component, name, a_record.get(name), b_record.get(name),  # type: ignore[arg-type]
                    launch=max(launch, 1), start=_start_of(cut, launch), detail=f"snapshot of step {step}",
                )  # fmt: skip
    return None


def _sources_kept(cut: _Cut, a: Sequence[Record]) -> _Cut:
    """``cut`` with its ``end`` records' ``files`` lacking each file a relaunch resumed from that A does not
    have at its end: neither Lightning's ``ModelCheckpoint`` nor retention deletes the checkpoint a run resumed
    from (model_checkpoint.py:1021-1023), so a relaunch from a file the uninterrupted run pruned later (killed
    between a top-k save and ``last.ckpt``, or resumed from an epoch-end file) keeps it, by rule, not by defect."""
    sources = {_basename(str(s["resumed_from"])) for s in cut.starts if s.get("resumed_from")}
    a_files = {name for r in a if r.get("kind") == "end" for name in r.get("files") or ()}
    kept = sources - a_files
    if not kept:
        return cut

    def without_sources(record: Record) -> Record:
        if record.get("kind") != "end" or not isinstance(record.get("files"), list):
            return record
        return {**record, "files": [name for name in record["files"] if name not in kept]}

    return replace(cut, records=tuple(without_sources(r) for r in cut.records))


def _basename(path: str) -> str:
    """The last part of a local path or a URL (``s3://b/run/x.ckpt``: ``x.ckpt``), as ``end.files`` lists it."""
    return path.rstrip("/").rsplit("/", 1)[-1]


def _compared_records(records: Sequence[Record]) -> list[Record]:
    out: list[Record] = []
    for record in records:
        if _compared(out[-1] if out else None, record):
            out.append(record)
    return out


def _compared(previous: Optional[Record], record: Record) -> bool:
    """``record`` is compared, following ``previous`` (the record kept before it): a kind in ``COMPARED_KINDS``,
    and not a ``saved`` record equal to the ``saved`` record right before it: a second file of the same
    state (a top-k file, then ``last.ckpt``; two checkpoint callbacks) within one launch, counted once in both
    runs. A kill between the two files leaves a relaunch that resumed from the first one, and no run redoes the
    second: by rule, not a difference. A relaunch that saves its resume step again is still an extra record."""
    if record.get("kind") not in COMPARED_KINDS:
        return False
    if previous is None or record.get("kind") != "saved" or previous.get("kind") != "saved":
        return True
    return not all(previous.get(k) == record.get(k) for k in set(previous) | set(record) if k not in IGNORED_FIELDS)


def _first_finding(rank: int, a: Sequence[Record], cut: _Cut) -> tuple[Optional[_Finding], int]:
    """The first difference of one rank (``None`` when all is equal), and how many records were compared."""
    b, problems = cut.records, {p.position: p for p in reversed(cut.problems)}
    for i in range(max(len(a), len(b)) + 1):
        if i in problems:
            return _problem_finding(rank, problems[i], cut), i
        if i >= len(a) and i >= len(b):
            break
        if i >= len(a) or i >= len(b):
            return _finding(rank, i, a, cut, _end_difference(a, b, i)), i
        difference = _record_difference(a[i], b[i])
        if difference is not None:
            return _finding(rank, i, a, cut, difference), i + 1
    return None, min(len(a), len(b))


def _problem_finding(rank: int, problem: _Problem, cut: _Cut) -> _Finding:
    return _Finding(
        problem.position, rank, problem.step, "start", "resumed_from", problem.expected, problem.got,
        launch=problem.launch, start=_start_of(cut, problem.launch), diagnosis=(problem.cause, problem.fix),
    )  # fmt: skip


def _start_of(cut: _Cut, launch: int) -> Record:
    return cut.starts[launch - 1] if 0 < launch <= len(cut.starts) else {}


_Difference = tuple[Component, str, Any, Any, Optional[str]]  # component, field, A's value, B's value, detail


def _record_difference(a: Record, b: Record) -> Optional[_Difference]:
    """The first field in which two records differ, in ``FIELD_COMPONENTS`` order, or ``None``. In a mapping
    or list of parts (``user``, ``sched``), the first part that differs is the ``detail``; its two values are
    the ones shown."""
    if a.get("kind") != b.get("kind"):
        return _kind_component(str(a.get("kind")), str(b.get("kind"))), "kind", _summary(a), _summary(b), None
    kind = str(a["kind"])
    known = FIELD_COMPONENTS[kind]
    listed = {name for name, _ in known}
    others = sorted((set(a) | set(b)) - IGNORED_FIELDS - listed)
    for name, component in [*known, *((o, OTHER_FIELDS.get(kind, "files")) for o in others)]:
        expected, got = a.get(name), b.get(name)
        if expected != got:
            if component == "missing" and _later(got, expected):
                component = "extra"
            if kind == "batch" and name in ("user", "sched"):
                part, expected, got = _first_part(expected, got)
                return component, name, expected, got, part
            return component, name, expected, got, None
    return None


def _first_part(a: Any, b: Any) -> tuple[str, Any, Any]:
    """The first name (a mapping, in A's order) or index (a list) whose values differ, and the two values."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        names = [*a, *(k for k in b if k not in a)]
        name = next(k for k in names if a.get(k) != b.get(k))
        return str(name), a.get(name), b.get(name)
    if isinstance(a, list) and isinstance(b, list):
        i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        return str(i), a[i] if i < len(a) else None, b[i] if i < len(b) else None
    return "", a, b


def _kind_component(a_kind: str, b_kind: str) -> Component:
    """Records of different kinds at one position. A validation in one run only is a validation schedule
    that was not restored (``val``); otherwise the run with the record the other lacks decides: B ends or
    lacks a save/digest A has (``missing``), or B trains on, saves or digests where A does not (``extra``)."""
    if "val" in (a_kind, b_kind):
        return "val"
    if b_kind == "end" or a_kind in ("saved", "state"):
        return "missing"
    return "extra"


def _end_difference(a: Sequence[Record], b: Sequence[Record], i: int) -> _Difference:
    if i >= len(b):
        return "missing", "kind", _summary(a[i]), None, None
    return "extra", "kind", None, _summary(b[i]), None


def _later(got: Any, expected: Any) -> bool:
    return isinstance(got, int) and isinstance(expected, int) and got > expected


def _summary(record: Record) -> dict[str, Any]:
    return {"kind": record.get("kind"), "step": record.get("step")}


def _finding(rank: int, i: int, a: Sequence[Record], cut: _Cut, difference: _Difference) -> _Finding:
    component, name, expected, got, detail = difference
    b = cut.records
    record = a[i] if i < len(a) else b[i]
    launch = cut.origins[i] if i < len(b) else len(cut.starts)
    if component == "val" and name in ("metrics", "logged"):
        detail = ", ".join(_differing(expected, got))
    rates = {json.dumps(r.get("lr")) for r in a if r.get("kind") == "batch"}
    return _Finding(
        i, rank, _step(record), component, name, expected, got, launch=max(launch, 1),
        start=_start_of(cut, launch), after_restore=_first_weights_after_restore(cut, i),
        last_steps=(_last_step(a), _last_step(b)), detail=detail, lr_varies=len(rates) > 1,
    )  # fmt: skip


def _differing(expected: Any, got: Any) -> list[str]:
    a, b = (value if isinstance(value, Mapping) else {} for value in (expected, got))
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def _first_weights_after_restore(cut: _Cut, i: int) -> bool:
    """Whether B's record ``i`` is the first to carry weights since its launch resumed (after a relaunch)."""
    if i >= len(cut.records) or cut.origins[i] not in cut.restores:
        return False
    begin = cut.restores[cut.origins[i]]
    return "params" in cut.records[i] and not any("params" in r for r in cut.records[begin:i])


def _step(record: Record) -> Optional[int]:
    step = record.get("step")
    return step if isinstance(step, int) else None


def _last_step(records: Sequence[Record]) -> Optional[int]:
    return next((s for r in reversed(records) if (s := _step(r)) is not None), None)


# ------------------------------------------------------------------------------------------ diagnosis

NOT_SURE = "not sure"
"""How a cause begins when the recorded evidence does not single one out."""


class Unsure(str):
    """A cause the recorded evidence does not single out: ``Verdict.sure`` is then ``False``, decided by this
    type where the cause is made (``_not_sure``), never by reading the cause's words."""


POSITION_FIX = (
    "use a torch DataLoader or torchdata's StatefulDataLoader (same arguments), whose position ExactResume saves,"
    " or give the batch sampler state_dict/load_state_dict"
)
GENERATOR_FIX = (
    "register the generator by name with ExactResume(state={name: generator}) (a torch, numpy or random generator),"
    " keep it on the model, the datamodule or the dataset where ExactResume finds it, or draw from torch's global RNG"
)
BUFFER_FIX = "register that state as a persistent buffer (register_buffer(name, tensor, persistent=True)), or save it in on_save_checkpoint and set it back in on_load_checkpoint"
SCHEDULER_FIX = "keep the scheduler on the module (ExactResume saves it there), register it with ExactResume(state={name: scheduler}), or return it from configure_optimizers ({'scheduler': s, 'interval': 'step'}) so Lightning saves it"


def _diagnose(f: _Finding) -> tuple[str, str]:
    """Cause and fix of the first difference: one sentence each, from the component that differed and the
    evidence the trace recorded (the launch's findings, loaders and schedulers), never from warning words."""
    if f.launch == 1 and f.component not in ("missing", "extra", "files"):
        return _not_deterministic(f)
    return _CAUSES[f.component](f)


def _named(found: Sequence[Finding]) -> str:
    """The findings as a clause: what ExactResume recorded about each subject, in its own words."""
    return "; ".join(f.line for f in found)


def _not_sure(what: str, compared: str, possible: str) -> Unsure:
    return Unsure(f"{NOT_SURE} why {what}: {compared}; nothing recorded singles out one cause; possible: {possible}")


def _not_deterministic(f: _Finding) -> tuple[str, str]:
    kernels = of_kind(f.findings, kinds.NONDETERMINISTIC_KERNELS)
    cause = (
        f"{f.component} differs at step {f.step} before B was ever killed (launch 1): the two runs differ without"
        " any resume, so the training itself is not deterministic" + (f" ({_named(kernels)})" if kernels else "")
    )
    fix = "make two uninterrupted runs equal first: seed everything (lightning.seed_everything), use Trainer(deterministic=True), and read no clock or environment in training"
    return cause, fix


def _unsaved_positions(f: _Finding) -> Optional[tuple[str, str]]:
    """The loaders whose position ExactResume recorded it could not save, as (clause, fix), or ``None``."""
    unsaved = of_kind(f.findings, kinds.LOADER_POSITION_UNSAVED)
    if not unsaved:
        return None
    names = ", ".join(x.subject for x in unsaved)
    return f"{names} could not have its position saved ({_named(unsaved)})", f"for {names}: {POSITION_FIX}"


def _start_problem(f: _Finding) -> Optional[tuple[str, str]]:
    """What the relaunch's restore recorded that explains any difference after it: a checkpoint captured
    mid-step, another world size (``None``: neither)."""
    mid = of_kind(f.findings, kinds.MID_STEP_CAPTURE)
    if mid:
        return (
            f"the relaunch resumed from a checkpoint captured {mid[0].subject.replace('_', ' ')}, not at a step boundary",
            (
                "let ExactResume take preemption snapshots (preemption.signals) instead of saving from a signal handler or an exception hook"
            ),
        )
    world = of_kind(f.findings, kinds.WORLD_SIZE)
    if world:
        return f"the relaunch ran on another world size ({world[0].subject} processes)", (
            "relaunch on the same number of processes (ExactResume(elastic=True) continues on another one, sample-exact but not bitwise)"
        )
    return None


def _batch(f: _Finding) -> tuple[str, str]:
    where = (
        f"batch content differs from step {f.step}"
        if f.field == "batch"
        else f"the batch position differs at step {f.step} ({f.field} {f.expected} expected, {f.got} found)"
    )
    for known in (_unsaved_positions(f), _start_problem(f)):
        if known is not None:
            return f"{where}: {known[0]}", known[1]
    recorded = f.start.get("loaders")
    loaders: Mapping[str, Any] = recorded if isinstance(recorded, Mapping) else {}
    each = [x for x in loaders.get("each") or () if isinstance(x, Mapping)]
    mode = loaders.get("mode")
    if f.field == "batch" and mode and len(each) > 1:
        cause = (
            f"{where} with the same position and RNG streams: the train loaders are combined (CombinedLoader"
            f" mode={mode!r}, {len(each)} loaders), and one of them resumed elsewhere than in the uninterrupted"
            " run (Lightning resumes a combined loader's members only as far as its mode tracks them: in"
            " 'max_size' a member that was exhausted yields again)"
        )
        fix = "keep ExactResume in the callbacks of every launch (it restores each member's position); if it still differs, report it with this trace, and meanwhile combine the data in one Dataset behind one DataLoader"
        return cause, fix
    iterable = [x for x in each if x.get("iterable")]
    if f.field == "batch" and iterable:
        names = ", ".join(str(x.get("dataset")) for x in iterable)
        cause = (
            f"{where} with the same position and RNG streams: the data comes from an IterableDataset ({names}),"
            " whose position and whatever it reads (a replay buffer, an environment) are its own state, which no"
            " checkpoint holds unless the dataset saves it"
        )
        fix = "give the dataset state_dict/load_state_dict (torchdata's Stateful) covering its position and the state it reads, so ExactResume saves it with the loader, or use a map-style Dataset"
        return cause, fix
    cause = _not_sure(
        where,
        "every train loader's position was saved and restored, and the RNG streams before it were equal",
        "randomness outside torch's RNG in the dataset or collate_fn (numpy, random), items that depend on state training changes",
    )
    return cause, "draw the data's randomness from torch's RNG, and keep what a dataset reads in the checkpoint"


def _rng(f: _Finding) -> tuple[str, str]:
    where = f"the RNG streams differ at the start of step {f.step}, before it ran"
    unsaved = _unsaved_positions(f)
    if unsaved is not None:  # a loader that cannot resume makes a new iterator, which draws its seed from the RNG
        return f"{where}: {unsaved[0]}, so the relaunch started a new iterator of it, which drew from them", unsaved[1]
    known = _start_problem(f)
    if known is not None:
        return f"{where}: {known[0]}", known[1]
    cause = _not_sure(
        where,
        "ExactResume restored the streams it saved, and every record before was equal",
        "something drew from them between the restore and this step (a hook that runs only on a resume, such as"
        " on_load_checkpoint, or setup code that draws before training), or ExactResume was not in every launch",
    )
    fix = "keep ExactResume in the callbacks of every launch, and draw no random numbers in hooks that run only on a resume (on_load_checkpoint) or before training starts"
    return cause, fix


def _loss(f: _Finding) -> tuple[str, str]:
    where = f"the loss differs at step {f.step} with the same batch and the same RNG streams"
    generators = of_kind(f.findings, kinds.UNSAVED_GENERATOR)
    buffers = of_kind(f.findings, kinds.UNSAVED_BUFFER)
    if buffers:  # observed to differ after the restore: stronger evidence than a generator that merely exists
        names = ", ".join(x.subject for x in buffers)
        cause = (
            f"{where}: state outside the checkpoint, the non-persistent buffer {names} that differed right after"
            " the restore, changed the computation"
        )
        also = ", ".join(x.subject for x in generators)
        return cause + (f" (ExactResume also found generators it does not save: {also})" if also else ""), BUFFER_FIX
    if generators:
        names = ", ".join(x.subject for x in generators)
        return f"{where}: an RNG stream outside ExactResume ({names}) changed the computation", GENERATOR_FIX
    held = of_kind(f.findings, kinds.USER_STATE)
    if held:
        return f"{where}: state ExactResume cannot capture changed the computation ({_named(held)})", (
            "save that state in on_save_checkpoint and set it back in on_load_checkpoint"
        )
    known = _start_problem(f)
    if known is not None:
        return f"{where}: {known[0]}", known[1]
    cause = _not_sure(
        where,
        "the batch, the RNG streams ExactResume saves and every captured state were equal, and ExactResume recorded no unsaved generator or buffer",
        "a random stream or state the model reads that no checkpoint holds and ExactResume's walk does not reach (an attribute of an object it does not walk, a global)",
    )
    return (
        cause,
        "register every generator and stateful object the model reads that ExactResume does not find with ExactResume(state={name: obj}), and keep state the forward reads in the state_dict",
    )


def _lr(f: _Finding) -> tuple[str, str]:
    where = f"the learning rate differs at step {f.step}"
    schedulers = [x for x in f.start.get("schedulers") or () if isinstance(x, Mapping)]
    if not schedulers and f.lr_varies:
        cause = (
            f"{where}: no LR scheduler is returned from configure_optimizers, yet the learning rate changes in the"
            " uninterrupted run, so something outside Lightning's checkpoint sets it (a scheduler the module keeps"
            " and steps by hand, or code that writes param_groups' lr), and the relaunch did not get its state back"
        )
        return cause, SCHEDULER_FIX
    if schedulers:
        types = ", ".join(str(x.get("type")) for x in schedulers)
        cause = (
            f"{where} while every scheduler Lightning saves ({types}) was equal at the start of the step: something"
            " outside them sets the learning rate (another scheduler stepped by hand, code that writes"
            " param_groups' lr), and its state was not restored"
        )
        return cause, SCHEDULER_FIX
    cause = _not_sure(
        where,
        "no LR scheduler is returned from configure_optimizers and the learning rate is constant in the uninterrupted run",
        "code that sets the learning rate only on a resume (on_load_checkpoint, a tuner) or from a value outside the checkpoint",
    )
    return cause, "set the learning rate only in configure_optimizers or through a scheduler returned from it"


def _sched(f: _Finding) -> tuple[str, str]:
    schedulers = [x for x in f.start.get("schedulers") or () if isinstance(x, Mapping)]
    index = int(f.detail) if f.detail and f.detail.isdigit() else None
    info = schedulers[index] if index is not None and index < len(schedulers) else {}
    which = f"LR scheduler {index} ({info.get('type', 'unknown type')})" if index is not None else "an LR scheduler"
    if f.field != "sched" or index is None:  # the end record: every scheduler's state at once
        cause = f"the LR schedulers' state differs at the end (step {f.step}) while every learning rate matched: a scheduler's own counters were not restored"
        return cause, "return every scheduler from configure_optimizers so Lightning saves and restores its state_dict"
    where = f"{which}, returned from configure_optimizers and saved by Lightning, differs at the start of step {f.step}"
    if info.get("plateau"):
        cause = (
            f"{where}: a plateau scheduler is stepped on a monitored metric at the end of an epoch, and Lightning"
            " skips that step in an epoch it resumed mid-way"
        )
        fix = "keep ExactResume in the callbacks of every launch (it makes up the step Lightning skipped); if it still differs, compare the validation metrics the scheduler monitors"
        return cause, fix
    cause = (
        f"{where} while the batch position and the RNG streams were equal: it was stepped outside Lightning's"
        f" schedule (by hand, in a hook) or changed after the restore"
    )
    return cause, "step it only through Lightning (the interval and frequency of its lr_scheduler config), not by hand"


def _user(f: _Finding) -> tuple[str, str]:
    held = [x for x in of_kind(f.findings, kinds.USER_STATE) if x.subject == f.detail]
    where = f"{f.detail} differs at the start of step {f.step}"
    if held:
        return f"{where}: {_named(held)}", "save that state in on_save_checkpoint and set it back in on_load_checkpoint"
    cause = (
        f"{where} (state ExactResume captures beyond Lightning's checkpoint) while the batch position and the RNG"
        " streams were equal: it was not restored as saved, or changed between the restore and this step (code"
        " that re-creates or resets it in a hook that runs on a resume: setup, on_train_start, on_load_checkpoint)"
    )
    return (
        cause,
        f"create {f.detail} once and change it only in training steps; if nothing resets it, report it with this trace",
    )


def _params(f: _Finding) -> tuple[str, str]:
    buffers = of_kind(f.findings, kinds.UNSAVED_BUFFER)
    if f.after_restore:
        where = (
            f"weights differ right after the restore (step {f.step}, the first weights recorded after launch"
            f" {f.launch} resumed) while every batch was equal"
        )
        if buffers:
            names = ", ".join(x.subject for x in buffers)
            return (
                f"{where}: state that is not in the state_dict, the non-persistent buffer {names}, changed the update",
                BUFFER_FIX,
            )
        cause = _not_sure(
            where,
            "ExactResume recorded no non-persistent buffer that differed after the restore",
            "state that is not in the state_dict (an attribute) changed the update, or the update itself (gradient accumulation position, scaler)",
        )
        return cause, BUFFER_FIX
    cause = _not_sure(
        f"the weights differ at step {f.step}",
        "every batch, RNG stream and loss before were equal",
        "the update differs (optimizer or gradient-scaler state, the gradient accumulation position), or something"
        " changes the weights outside the optimizer step",
    )
    fix = "keep everything the update reads in the checkpoint: optimizers and schedulers returned by configure_optimizers, and on_save_checkpoint/on_load_checkpoint for the rest"
    return cause, fix


def _optim(f: _Finding) -> tuple[str, str]:
    if f.after_restore and not f.lr_varies:  # the first state B recorded after its restore, at a constant LR
        cause = f"the optimizer state differs at step {f.step}, right after the restore, while the weights were equal: it was not restored (an optimizer made outside configure_optimizers, or state kept outside its state_dict)"
        return cause, "create the optimizers in configure_optimizers so Lightning saves and restores their state_dict"
    cause = _not_sure(
        f"the optimizer state differs at step {f.step}",
        "the weights and batches before were equal"
        + ("" if f.after_restore else ", and it was equal in the first state recorded after the restore"),
        "something no checkpoint holds changed it during training: an LR scheduler or code that sets"
        " param_group['lr'] or other hyper-parameters (a scheduler object ExactResume's walk does not reach)"
        + (", or the optimizer's state was not restored" if f.after_restore else ""),
    )
    fix = "return the scheduler from configure_optimizers, keep it on the module (ExactResume saves it there), or register it with ExactResume(state={name: scheduler})"
    return cause, fix


def _val(f: _Finding) -> tuple[str, str]:
    if f.field in ("kind", "step"):
        cause = f"validation ran at another point than in the uninterrupted run (step {f.step}): the validation schedule's position was not restored"
        fix = "validate on a step-based schedule (val_check_interval as a number of batches, or check_val_every_n_epoch) and keep ExactResume in every launch"
        return cause, fix
    which = "logged metrics" if f.field == "logged" else "validation metrics"
    cause = _not_sure(
        f"the {which} {f.detail} differ at step {f.step}",
        "every training record before (batches, RNG streams, losses, learning rates, weights) was equal",
        "a metric's state accumulated across the resume (a torchmetrics metric on the module: its state is in no"
        " checkpoint), or validation data with randomness of its own",
    )
    fix = "reset each metric's state at the start of every validation and give the validation loader no randomness of its own"
    return cause, fix


def _files(f: _Finding) -> tuple[str, str]:
    expected, got = set(f.expected or ()), set(f.got or ())
    sides = [
        (sorted(expected - got), "only in the uninterrupted run"),
        (sorted(got - expected), "only in the killed run"),
    ]
    named = (
        ", ".join(f"{where} {names}" for names, where in sides if names) or "the same names, listed in another order"
    )
    cause = f"the checkpoint files written differ: {named}"
    fix = "name checkpoints by step only (no time or version: a -v1 suffix means the name existed already) and let retention decide by step, so a relaunch writes and prunes the same files"
    return cause, fix


def _step_count_cause(f: _Finding, more_or_fewer: str) -> str:
    a_last, b_last = f.last_steps
    stops = of_kind(f.findings, kinds.WALL_CLOCK_STOP)
    return (
        f"the killed run trained {more_or_fewer} steps than the uninterrupted one: at step {f.step} it has"
        f" {_shown(f.got)} where A has {_shown(f.expected)} (B's records end at step {b_last}, A's at step {a_last})"
        + (f"; {_named(stops)}" if stops else "")
    )


def _missing(f: _Finding) -> tuple[str, str]:
    fix = "stop on a step count (max_steps or max_epochs, not max_time), and save every checkpoint the uninterrupted run saves"
    return _step_count_cause(f, "fewer"), fix


def _extra(f: _Finding) -> tuple[str, str]:
    fix = "stop on a step count (max_steps or max_epochs, not max_time), and make the checkpoint schedule depend on the step only, not on the launch"
    return _step_count_cause(f, "more"), fix


def _shown(summary: Any) -> str:
    if not isinstance(summary, Mapping):
        return "no record"
    kind = str(summary.get("kind"))
    return f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind} record of step {summary.get('step')}"


_CAUSES: Mapping[Component, Callable[[_Finding], tuple[str, str]]] = {
    "batch": _batch, "rng": _rng, "loss": _loss, "lr": _lr, "params": _params, "optim": _optim, "val": _val,
    "sched": _sched, "user": _user, "files": _files, "missing": _missing, "extra": _extra,
}  # fmt: skip
"""One diagnosis per component (``start`` problems carry their own cause and fix)."""


# -------------------------------------------------------------------------------------------- output


def to_json(verdict: Verdict) -> dict[str, Any]:
    """The verdict as JSON-ready data, a stable schema (ranks become string keys, as JSON requires)::

    {"verdict": "EXACT" | "DIFFERS",
     "step": int | null, "rank": int | null, "component": str | null,   # null when EXACT
     "detail": str | null,                                               # which scheduler, state, metrics
     "expected": <JSON value> | null, "got": <JSON value> | null,        # A's and B's values
     "cause": str, "fix": str, "sure": bool,                             # "" and true when EXACT
     "launches": {"<rank>": int}, "resumed_at": {"<rank>": [int, ...]}, "compared": {"<rank>": int}}
    """
    return {
        "verdict": "EXACT" if verdict.exact else "DIFFERS",
        "step": verdict.step,
        "rank": verdict.rank,
        "component": verdict.component,
        "detail": verdict.detail,
        "expected": verdict.expected,
        "got": verdict.got,
        "cause": verdict.cause,
        "fix": verdict.fix,
        "sure": verdict.sure,
        "launches": {str(r): int(n) for r, n in verdict.launches.items()},
        "resumed_at": {str(r): [int(s) for s in steps] for r, steps in verdict.resumed_at.items()},
        "compared": {str(r): int(n) for r, n in verdict.compared.items()},
    }


def render(verdict: Verdict) -> str:
    """The verdict as plain text: the verdict line, what differs, cause, fix, then one row per rank."""
    if verdict.exact:
        lines = ["EXACT", "every compared record of the killed and relaunched run equals the uninterrupted run's"]
    else:
        where = f" at step {verdict.step}" if verdict.step is not None else ""
        rank = f" (rank {verdict.rank})" if verdict.rank is not None else ""
        detail = f" {verdict.detail}" if verdict.detail else ""
        lines = [f"DIFFERS{where}{rank}: {verdict.component}{detail}"]
        if verdict.expected is not None or verdict.got is not None:
            lines += [f"expected: {_short(verdict.expected)}", f"got:      {_short(verdict.got)}"]
        lines += [f"cause:    {verdict.cause}", f"fix:      {verdict.fix}"]
    return "\n".join([*lines, "", *_table(verdict)])


def _table(verdict: Verdict) -> list[str]:
    ranks = sorted(set(verdict.launches) | set(verdict.compared))
    rows = [("rank", "launches", "resumed at", "records compared")]
    for r in ranks:
        steps = ", ".join(str(s) for s in verdict.resumed_at.get(r, ())) or "-"
        rows.append((str(r), str(verdict.launches.get(r, 0)), steps, str(verdict.compared.get(r, 0))))
    widths = [max(len(row[c]) for row in rows) for c in range(4)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def _short(value: Any, limit: int = 100) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."
