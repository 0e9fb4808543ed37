"""The schedule's options, validated once: ``ScheduleConfig`` and the defaults it is built with.

``ExactResume`` builds one ``ScheduleConfig`` from its option groups (``schedule.options.resolve`` calls
``ScheduleConfig.from_user``: durations as ``"24h"``, seconds or ``timedelta``) and passes it on whole to the
scheduler; every problem is collected into one ``ConfigurationError`` naming the option by its path in
``ExactResume``'s arguments (``LABELS``), the value and the fix. Pure data: no clock, no files, no
Lightning, no decisions (those are ``state``'s).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional, Union, cast

from lightning_resume.durations import Duration, parse_duration
from lightning_resume.errors import ConfigurationError
from lightning_resume.schedule.formulas import Formula

DEFAULT_MIN_INTERVAL: Duration = "1min"
DEFAULT_MAX_INTERVAL: Duration = "6h"
DEFAULT_INITIAL_COST: Duration = "60s"
DEFAULT_CHECK_INTERVAL: Duration = "10s"
DEFAULT_MEMORY_INITIAL_COST: Duration = "5s"
DEFAULT_MTBF: Duration = "observed"
DEFAULT_MTBF_PRIOR: Duration = "30d"
DEFAULT_PROCESS_MTBF_PRIOR: Duration = "1h"
DEFAULT_JOB_LOSS_MTBF_PRIOR: Duration = "30d"
DEFAULT_REPLICA_INITIAL_COST: Duration = "5s"
"""The schedule's defaults, written once: ``ScheduleConfig`` and ``ExactResume``'s arguments use these.

The MTBF prior is per node. Meta's Llama 3 405B run (Llama 3 paper, 2024) saw 419 unexpected
interruptions in 54 days on 2,048 nodes of 8 H100s: about 6,300 h (260 days) per node. The prior is
about 9x shorter, for clusters less tended than that one, preemptible capacity and software failures;
if the truth is k times longer the waste is (sqrt(k) + 1/sqrt(k)) / 2 of the optimum (1.7x at k = 9),
and the observed history replaces the prior as failures (or failure-free time) accumulate. The process
MTBF prior (M1, the memory tier's failures: exceptions, OOM kills, timeouts, deploys, which keep the
machine) is the common kind of failure, so it is much shorter; the history refines it the same way.

With replicas (three-level schedule) the node MTBF prior prices node losses (a peer's replica survives
them) and a job-loss prior, for the whole job (not per node), prices what sends every rank back to the
durable tier: every node's memory gone at once (a rack's switch or power, a job moved to other nodes) or a
node and its replica holder both lost. None of the 419 interruptions of the Llama 3 run lost more than one
host's memory in its 54 days (Llama 3 paper, table 5: each cause is one component); one such loss a month
(about half that run) errs towards more frequent durable saves, and the history refines it.
``DEFAULT_REPLICA_INITIAL_COST`` is the transfer time D2 assumed before the first replica is measured."""


LABELS = {
    "num_nodes": "schedule.num_nodes",
    "formula": "schedule.formula",
    "min_interval": "schedule.min_interval",
    "max_interval": "schedule.max_interval",
    "every_n_train_steps_max": "schedule.every_n_train_steps_max",
    "mtbf_prior": "schedule.mtbf_prior",
    "initial_cost": "schedule.initial_cost",
    "check_interval": "schedule.check_interval",
    "process_mtbf": "memory_tier.process_mtbf",
    "memory_every_n_train_steps_max": "memory_tier.every_n_train_steps_max",
    "replicas": "memory_tier.replicas",
}
"""How each option is named in a message: its path in ``ExactResume``'s groups (``mtbf`` is top-level; the
rest, such as ``prior_weight``, are not user options and keep their own name)."""


def label(name: str) -> str:
    """``name`` as the user wrote it: ``"min_interval"`` -> ``"schedule.min_interval"``."""
    return LABELS.get(name, name)


class MtbfMode(str, Enum):
    """Where the job's M comes from."""

    CONFIGURED = "configured"  # M = mtbf / num_nodes, fixed
    OBSERVED = "observed"  # M from the run's failure history, with the configured value as prior


def _positive(value: Optional[float]) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def _positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _mtbf_problems(name: str, mtbf_s: Optional[float], mode: MtbfMode, examples: tuple, off: str) -> list:
    """An MTBF's problems; ``examples``: a value and a prior to suggest, ``off``: what ``None`` means."""
    p = []
    if mtbf_s is not None and not _positive(mtbf_s):
        p.append(f"{label(name)}={mtbf_s!r}s must be > 0; use a duration like {examples[0]!r}, or None {off}")
    if mode is MtbfMode.OBSERVED and mtbf_s is None:
        p.append(f"{label(name)}='observed' needs a prior; give {label(name + '_prior')}, e.g. {examples[1]!r}")
    return p


def _cap_problems(name: str, cap: Optional[int], off: str) -> list:
    """A step cap's problem, if any; ``off`` says what ``None`` means."""
    if cap is None or _positive_int(cap):
        return []
    return [f"{label(name)}={cap!r} must be an integer >= 1, or None for {off}"]


@dataclass(frozen=True)
class ScheduleConfig:
    """Validated schedule options; every duration is in seconds.

    ``mtbf_s`` is the per-node MTBF (``None`` turns time-based snapshots off; a step cap still
    applies). In ``MtbfMode.OBSERVED`` it is the prior, worth ``prior_weight`` pseudo-failures.
    ``initial_cost_s`` is the conservative C used before the first measurement (reported only:
    the first save happens as soon as ``min_interval_s`` has passed, to measure C).
    ``check_interval_s`` bounds the time between two decisions, so a preemption flag raised on any
    rank is seen within it and rank 0 broadcasts at most once per check.

    Two-level schedule (memory tier): ``process_mtbf_s`` is the per-node mean time between *process*
    failures that leave the node and its shared memory alive (M1; ``mtbf_s`` stays the node MTBF,
    M2). ``None`` with no ``memory_every_n_train_steps_max`` is the single-level schedule, exactly as
    before. ``memory_initial_cost_s`` is the conservative C1 assumed before the first measurement.
    In ``process_mtbf_mode`` OBSERVED, ``process_mtbf_s`` is the prior of M1.

    Three-level schedule (replicas, ``replicas`` > 0 or ``None`` on more than one node; ``None`` resolves as
    the memory tier does: 1 with more than one node, else 0): ``mtbf_s`` then prices node losses (back to
    a peer's replica) and ``job_loss_mtbf_s`` (for the whole job, not per node) whole-job losses (back to
    the durable tier); in ``mtbf_mode`` OBSERVED both are priors. ``replica_initial_cost_s`` is the
    transfer time assumed before the first replica is measured. ``replicas=0`` is the two-level schedule,
    exactly as before.
    """

    mtbf_s: Optional[float] = None
    num_nodes: int = 1
    formula: Formula = Formula.YOUNG
    min_interval_s: float = parse_duration(DEFAULT_MIN_INTERVAL)
    max_interval_s: float = parse_duration(DEFAULT_MAX_INTERVAL)
    every_n_train_steps_max: Optional[int] = None
    initial_cost_s: float = parse_duration(DEFAULT_INITIAL_COST)
    mtbf_mode: MtbfMode = MtbfMode.CONFIGURED
    prior_weight: float = 1.0
    check_interval_s: float = parse_duration(DEFAULT_CHECK_INTERVAL)
    process_mtbf_s: Optional[float] = None
    memory_every_n_train_steps_max: Optional[int] = None
    process_mtbf_mode: MtbfMode = MtbfMode.CONFIGURED
    memory_initial_cost_s: float = parse_duration(DEFAULT_MEMORY_INITIAL_COST)
    replicas: Optional[int] = 0
    job_loss_mtbf_s: float = parse_duration(DEFAULT_JOB_LOSS_MTBF_PRIOR)
    replica_initial_cost_s: float = parse_duration(DEFAULT_REPLICA_INITIAL_COST)

    def __post_init__(self) -> None:
        problems = []
        for name, enum in (("formula", Formula), ("mtbf_mode", MtbfMode), ("process_mtbf_mode", MtbfMode)):
            try:
                object.__setattr__(self, name, enum(getattr(self, name)))
            except ValueError:
                choices = ", ".join(repr(e.value) for e in enum)
                problems.append(f"{label(name)}={getattr(self, name)!r} is not one of {choices}")
        problems += self._problems()
        if problems:
            raise ConfigurationError("ScheduleConfig", problems)

    def _problems(self) -> list:
        p = _mtbf_problems("mtbf", self.mtbf_s, self.mtbf_mode, ("24h", "24h"), "to turn scheduled snapshots off")
        if not _positive_int(self.num_nodes):
            p.append(f"{label('num_nodes')}={self.num_nodes!r} must be an integer >= 1")
        if not (math.isfinite(self.min_interval_s) and self.min_interval_s >= 0):
            p.append(f"{label('min_interval')}={self.min_interval_s!r}s must be >= 0")
        if not _positive(self.max_interval_s) or self.max_interval_s < self.min_interval_s:
            p.append(
                f"{label('max_interval')}={self.max_interval_s!r}s must be > 0 and >= "
                f"{label('min_interval')}={self.min_interval_s!r}s"
            )
        p += _cap_problems("every_n_train_steps_max", self.every_n_train_steps_max, "no step cap")
        if not _positive(self.initial_cost_s):
            p.append(
                f"{label('initial_cost')}={self.initial_cost_s!r}s must be > 0 "
                "(a conservative guess of the save's blocking time)"
            )
        if not _positive(self.prior_weight):
            p.append(f"prior_weight={self.prior_weight!r} must be > 0 (pseudo-failures the prior MTBF counts for)")
        if not _positive(self.check_interval_s):
            p.append(f"{label('check_interval')}={self.check_interval_s!r}s must be > 0")
        return p + self._memory_problems()

    def _memory_problems(self) -> list:
        mode, off = self.process_mtbf_mode, "for the default pacing"
        p = _mtbf_problems("process_mtbf", self.process_mtbf_s, mode, ("1h", "6h"), off)
        p += _cap_problems("memory_every_n_train_steps_max", self.memory_every_n_train_steps_max, "no memory step cap")
        if not _positive(self.memory_initial_cost_s):
            p.append(
                f"memory_initial_cost={self.memory_initial_cost_s!r}s must be > 0 "
                "(a conservative guess of a memory snapshot's blocking time)"
            )
        return p + self._replica_problems()

    def _replica_problems(self) -> list:
        p = []
        r = self.replicas
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
            p.append(f"{label('replicas')}={r!r} must be an integer >= 0 (copies on other nodes), or null for auto")
        if not _positive(self.job_loss_mtbf_s):
            p.append(f"job_loss_mtbf={self.job_loss_mtbf_s!r}s must be > 0 (mean time between whole-job losses)")
        if not _positive(self.replica_initial_cost_s):
            p.append(f"replica_initial_cost={self.replica_initial_cost_s!r}s must be > 0 (a replica transfer's time)")
        return p

    @property
    def job_mtbf_s(self) -> Optional[float]:
        """The configured (or prior) M for the whole job: per-node MTBF / num_nodes."""
        return None if self.mtbf_s is None else self.mtbf_s / self.num_nodes

    @property
    def job_process_mtbf_s(self) -> Optional[float]:
        """The configured (or prior) M1 for the whole job: per-node process MTBF / num_nodes."""
        return None if self.process_mtbf_s is None else self.process_mtbf_s / self.num_nodes

    @property
    def takes_memory_snapshots(self) -> bool:
        """Whether the memory tier is on (a process MTBF or a memory step cap is configured)."""
        return self.process_mtbf_s is not None or self.memory_every_n_train_steps_max is not None

    @property
    def replica_count(self) -> int:
        """Replicas per snapshot, resolved: ``replicas``, or for ``None`` 1 with more than one node, else 0."""
        if self.replicas is None:
            return 1 if self.num_nodes > 1 else 0
        return self.replicas

    @property
    def replicates(self) -> bool:
        """Whether the schedule is three-level: a memory tier with replicas on peer nodes."""
        return self.takes_memory_snapshots and self.replica_count > 0

    @property
    def takes_snapshots(self) -> bool:
        """Whether the durable tier ever saves on its own (an MTBF or a step cap is configured)."""
        return self.mtbf_s is not None or self.every_n_train_steps_max is not None

    @property
    def asked_for_snapshots(self) -> bool:
        """Whether the user configured snapshots explicitly (a fixed MTBF or a step cap), rather than
        leaving the default observed schedule on."""
        fixed = self.mtbf_mode is MtbfMode.CONFIGURED and self.mtbf_s is not None
        return fixed or self.every_n_train_steps_max is not None

    def single_level(self) -> ScheduleConfig:
        """The same durable-tier options without a memory tier (the run has none after all)."""
        return dataclasses.replace(
            self,
            process_mtbf_s=None,
            memory_every_n_train_steps_max=None,
            process_mtbf_mode=MtbfMode.CONFIGURED,
            replicas=0,
        )

    @classmethod
    def from_user(
        cls,
        mtbf: Union[Duration, None] = None,
        num_nodes: int = 1,
        formula: Union[str, Formula] = Formula.YOUNG,
        min_interval: Duration = DEFAULT_MIN_INTERVAL,
        max_interval: Duration = DEFAULT_MAX_INTERVAL,
        every_n_train_steps_max: Optional[int] = None,
        initial_cost: Duration = DEFAULT_INITIAL_COST,
        mtbf_prior: Optional[Duration] = None,
        check_interval: Duration = DEFAULT_CHECK_INTERVAL,
        process_mtbf: Union[Duration, None] = None,
        memory_every_n_train_steps_max: Optional[int] = None,
        process_mtbf_prior: Optional[Duration] = None,
        memory_initial_cost: Duration = DEFAULT_MEMORY_INITIAL_COST,
        replicas: Optional[int] = 0,
    ) -> ScheduleConfig:
        """Build from user-facing values (durations as ``"24h"``, seconds or ``timedelta``).

        ``mtbf="observed"`` estimates M from the failure history with ``mtbf_prior`` as prior.
        ``process_mtbf`` (M1, per node) turns the memory tier on with the two-level schedule;
        ``process_mtbf="observed"`` estimates it from the history (process failures: resumes from
        the memory tier) with ``process_mtbf_prior`` as prior. ``mtbf`` stays the node MTBF (M2).
        ``replicas`` (the memory tier's; ``None``: 1 with more than one node) makes it three-level.
        Every problem is collected into one ``ConfigurationError``.
        """
        seconds = _Seconds(cls)
        observed, p_observed = _is_observed(mtbf), _is_observed(process_mtbf)
        mtbf_s = seconds.optional(mtbf_prior, "mtbf_prior") if observed else seconds.optional(mtbf, "mtbf")
        process_s = (
            seconds.optional(process_mtbf_prior, "process_mtbf_prior")
            if p_observed
            else seconds.optional(process_mtbf, "process_mtbf")
        )
        try:
            config = cls(
                mtbf_s=mtbf_s,
                num_nodes=num_nodes,
                formula=cast(Formula, formula),  # __post_init__ coerces a string and reports an unknown one
                min_interval_s=seconds(min_interval, "min_interval"),
                max_interval_s=seconds(max_interval, "max_interval"),
                every_n_train_steps_max=every_n_train_steps_max,
                initial_cost_s=seconds(initial_cost, "initial_cost"),
                mtbf_mode=MtbfMode.OBSERVED if observed else MtbfMode.CONFIGURED,
                check_interval_s=seconds(check_interval, "check_interval"),
                process_mtbf_s=process_s,
                memory_every_n_train_steps_max=memory_every_n_train_steps_max,
                process_mtbf_mode=MtbfMode.OBSERVED if p_observed else MtbfMode.CONFIGURED,
                memory_initial_cost_s=seconds(memory_initial_cost, "memory_initial_cost"),
                replicas=replicas,
            )
        except ConfigurationError as err:
            raise ConfigurationError("ScheduleConfig", seconds.problems + err.problems) from None
        if seconds.problems:
            raise ConfigurationError("ScheduleConfig", seconds.problems)
        return config

    def with_nodes(self, num_nodes: int, replicas: Optional[int] = None) -> ScheduleConfig:
        """The same options for ``num_nodes`` nodes (known only once the trainer is set up); ``replicas``: the
        count the memory tier resolved, when it is known (it replaces the option's)."""
        if replicas is None:
            return dataclasses.replace(self, num_nodes=num_nodes)
        return dataclasses.replace(self, num_nodes=num_nodes, replicas=replicas)


class _Seconds:
    """Parses durations into seconds, keeping every error; a bad value becomes a valid stand-in (the
    field's default, or 1 s for an MTBF) so that the config's own checks still find the other problems."""

    def __init__(self, config: type) -> None:
        self.config = config
        self.problems: list[str] = []

    def __call__(self, value: Duration, name: str) -> float:
        stand_in: float = getattr(self.config, name + "_s")
        return self._parse(value, name, stand_in)

    def optional(self, value: Optional[Duration], name: str) -> Optional[float]:
        return None if value is None else self._parse(value, name, 1.0)

    def _parse(self, value: Duration, name: str, stand_in: float) -> float:
        try:
            return parse_duration(value, label(name))
        except ValueError as err:
            self.problems.append(str(err))
            return stand_in


def _is_observed(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == MtbfMode.OBSERVED.value
