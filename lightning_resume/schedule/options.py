"""ExactResume's option groups, as users write them in Python or in LightningCLI YAML.

One frozen dataclass per concern: ``ScheduleOptions`` (when durable snapshots are taken),
``MemoryTierOptions`` (the shared-memory tier: where, and how often) and ``PreemptionOptions`` (the signals
and cloud notices that ask for a snapshot and a stop). jsonargparse builds each from a nested YAML mapping
(``schedule: {min_interval: 5min}``). Pure data: durations stay as given (``"5min"``, seconds or a
``timedelta``); ``resolve`` parses them once and collects every problem, each named by its path
(``schedule.min_interval=...``). No annotation here is postponed: tools that build parsers from a signature
need real objects.
"""

import math
from dataclasses import dataclass
from typing import Any, Literal, Optional, Sequence, Union

from lightning_resume.cloud.detect import DMI_DIR, resolve_clouds
from lightning_resume.durations import Duration, parse_duration
from lightning_resume.errors import ConfigurationError
from lightning_resume.schedule.config import (
    DEFAULT_CHECK_INTERVAL,
    DEFAULT_INITIAL_COST,
    DEFAULT_MAX_INTERVAL,
    DEFAULT_MIN_INTERVAL,
    DEFAULT_MTBF_PRIOR,
    DEFAULT_PROCESS_MTBF_PRIOR,
    MtbfMode,
    ScheduleConfig,
)
from lightning_resume.schedule.preemption import DEFAULT_SIGNALS, parse_signals

DEFAULT_MEMORY_DIR = "/dev/shm"
"""Where each user's memory root is made unless ``MemoryTierOptions(dir=...)`` names another tmpfs."""
DEFAULT_POLL_INTERVAL: Duration = "5s"
ON_NOTICE = ("stop", "snapshot")
NoticeSpec = Union[None, str, Sequence[str]]


def _as_tuple(value: Any) -> Any:
    """A list as YAML gives it becomes a tuple, so that the Python and YAML forms of a group compare equal."""
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True)
class ScheduleOptions:
    """When durable snapshots are taken: every T* = sqrt(2 C M), clamped, with an optional step cap.

    Args:
        num_nodes: nodes sharing the failure rate (default: the trainer's ``num_nodes``).
        formula: ``"young"`` (T* = sqrt(2 C M)) or ``"daly"`` (Daly's refinement).
        min_interval: shortest interval between two snapshots.
        max_interval: longest interval between two snapshots.
        every_n_train_steps_max: take a snapshot at least every this many optimizer steps.
        mtbf_prior: the prior per-node MTBF for ``mtbf="observed"``.
        initial_cost: conservative guess of C, a save's blocking time, before the first measurement.
        check_interval: longest time between two schedule decisions; bounds how late a preemption is seen.
    """

    num_nodes: Optional[int] = None
    formula: Literal["young", "daly"] = "young"
    min_interval: Duration = DEFAULT_MIN_INTERVAL
    max_interval: Duration = DEFAULT_MAX_INTERVAL
    every_n_train_steps_max: Optional[int] = None
    mtbf_prior: Optional[Duration] = DEFAULT_MTBF_PRIOR
    initial_cost: Duration = DEFAULT_INITIAL_COST
    check_interval: Duration = DEFAULT_CHECK_INTERVAL


@dataclass(frozen=True)
class MemoryTierOptions:
    """The memory tier: each rank's newest snapshot in shared memory, which outlives a crashed process.

    Args:
        dir: a local tmpfs; snapshots live in this user's own root under it (mode 0700).
        process_mtbf: mean time between failures that keep the machine, or ``"observed"``. ``None``:
            observed with a 1 h prior, unless ``every_n_train_steps_max`` alone paces the tier.
        every_n_train_steps_max: take a memory snapshot at least every this many optimizer steps.
        replicas: how many other nodes keep a copy of each rank's snapshot in their memory tier, so that the
            run survives the loss of a node. ``None``: 1 when the job has more than one node, else 0.
    """

    dir: str = DEFAULT_MEMORY_DIR
    process_mtbf: Optional[Duration] = None
    every_n_train_steps_max: Optional[int] = None
    replicas: Optional[int] = None


@dataclass(frozen=True)
class PreemptionOptions:
    """What asks for a snapshot and a stop at the next step boundary: signals, and cloud notices.

    Args:
        signals: signals whose handler only sets a flag; ``None`` or ``[]`` leaves signals alone.
        notices: ``"auto"`` polls the metadata endpoint of the cloud this machine is on; or a list such as
            ``["aws"]``; ``None`` polls nothing.
        on_notice: ``"stop"``: snapshot, then stop cleanly; ``"snapshot"``: snapshot and keep training.
        endpoint: base URL of the metadata service instead of the cloud's own (a proxy, a test server).
        poll_interval: time between two polls of the metadata endpoint.
        dmi_dir: where the DMI evidence for ``notices="auto"`` is read.
    """

    signals: Optional[Sequence[str]] = DEFAULT_SIGNALS
    notices: NoticeSpec = None
    on_notice: Literal["stop", "snapshot"] = "stop"
    endpoint: Optional[str] = None
    poll_interval: Duration = DEFAULT_POLL_INTERVAL
    dmi_dir: str = DMI_DIR

    def __post_init__(self) -> None:
        signals = (self.signals,) if isinstance(self.signals, str) else self.signals  # one name, as YAML reads it
        object.__setattr__(self, "signals", _as_tuple(signals))
        object.__setattr__(self, "notices", _as_tuple(self.notices))


@dataclass(frozen=True)
class Resolved:
    """The groups, validated: the schedule of both tiers and the notice poll interval, in seconds.

    ``schedule`` is ``None`` when ``problems`` is not empty."""

    schedule: Optional[ScheduleConfig]
    poll_interval_s: float
    problems: tuple[str, ...]


GROUPS = {"schedule": ScheduleOptions, "memory_tier": MemoryTierOptions, "preemption": PreemptionOptions}


def resolve(
    mtbf: Optional[Duration],
    schedule: ScheduleOptions,
    memory_tier: Optional[MemoryTierOptions],
    preemption: Optional[PreemptionOptions],
) -> Resolved:
    """Every option parsed once and checked, every problem collected (the schedule's by ``ScheduleConfig``)."""
    wrong = group_problems(schedule=schedule, memory_tier=memory_tier, preemption=preemption)
    if wrong:  # a group of another type has no fields to read
        return Resolved(None, parse_duration(DEFAULT_POLL_INTERVAL), tuple(wrong))
    problems = memory_tier_problems(memory_tier) if memory_tier is not None else []
    poll_s = parse_duration(DEFAULT_POLL_INTERVAL)
    if preemption is not None:
        poll_s, found = preemption_problems(preemption)
        problems += found
    try:
        config = ScheduleConfig.from_user(mtbf=mtbf, **schedule_args(schedule), **memory_args(memory_tier))
    except ConfigurationError as err:
        return Resolved(None, poll_s, tuple(dict.fromkeys(problems + err.problems)))  # replicas: checked by both
    return Resolved(None if problems else config, poll_s, tuple(problems))


def group_problems(**groups: Any) -> list[str]:
    """A group given as something other than its dataclass (``memory_tier=True``), named with the fix."""
    problems = []
    for name, value in groups.items():
        kind = GROUPS[name]
        if value is not None and not isinstance(value, kind) or value is None and name == "schedule":
            example = "{}" if name == "memory_tier" else "{min_interval: 5min}"
            problems.append(
                f"{name}={value!r} must be a {kind.__name__}(...); in YAML a mapping such as {name}: {example}"
            )
    return problems


def schedule_args(schedule: ScheduleOptions) -> dict[str, Any]:
    """``ScheduleConfig.from_user``'s arguments from the schedule group."""
    return {
        "num_nodes": 1 if schedule.num_nodes is None else schedule.num_nodes,  # None: the trainer's, once known
        "formula": schedule.formula,
        "min_interval": schedule.min_interval,
        "max_interval": schedule.max_interval,
        "every_n_train_steps_max": schedule.every_n_train_steps_max,
        "mtbf_prior": schedule.mtbf_prior,
        "initial_cost": schedule.initial_cost,
        "check_interval": schedule.check_interval,
    }


def memory_args(memory_tier: Optional[MemoryTierOptions]) -> dict[str, Any]:
    """The schedule's memory-tier options: the tier on with neither option set is paced by an observed
    process MTBF (1 h prior); a step cap alone stays a pure step cap; no tier, no memory snapshots."""
    if memory_tier is None:
        return {}
    process_mtbf, every = memory_tier.process_mtbf, memory_tier.every_n_train_steps_max
    if process_mtbf is None and every is None:
        process_mtbf = MtbfMode.OBSERVED.value
    prior = DEFAULT_PROCESS_MTBF_PRIOR if process_mtbf == MtbfMode.OBSERVED.value else None
    return {
        "process_mtbf": process_mtbf,
        "memory_every_n_train_steps_max": every,
        "process_mtbf_prior": prior,
        "replicas": memory_tier.replicas,
    }


def memory_tier_problems(memory_tier: MemoryTierOptions) -> list[str]:
    """What is wrong with the memory tier's own options (its pacing is ``ScheduleConfig``'s to check)."""
    where = memory_tier.dir
    if not isinstance(where, str) or not where:
        return [f"memory_tier.dir={where!r} must be a local (tmpfs) directory such as /dev/shm"]
    if "://" in where and not where.startswith("file://"):
        return [f"memory_tier.dir={where!r} must be a local (tmpfs) directory such as /dev/shm/..."]
    replicas = memory_tier.replicas
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0):
        return [f"memory_tier.replicas={replicas!r} must be an integer >= 0 (copies on other nodes), or null for auto"]
    return []


def preemption_problems(preemption: PreemptionOptions) -> tuple[float, list[str]]:
    """The notice poll interval in seconds, and every problem with the preemption group."""
    problems = []
    try:
        parse_signals(preemption.signals or ())
    except ValueError as err:
        problems.append(f"preemption.{err}")  # parse_signals names the option ``signals=``
    try:
        poll_s = parse_duration(preemption.poll_interval, "preemption.poll_interval")
    except ValueError as err:
        problems.append(str(err))
        poll_s = parse_duration(DEFAULT_POLL_INTERVAL)
    problems += notice_problems(preemption.notices, preemption.on_notice, preemption.endpoint, poll_s)
    return poll_s, problems


def notice_problems(spec: NoticeSpec, on_notice: str, endpoint: Optional[str], interval_s: float) -> list[str]:
    """Every problem with the notice options, one line each (for ``ConfigurationError``)."""
    problems = []
    if spec is not None and spec != "auto":
        try:
            resolve_clouds(list(spec) if not isinstance(spec, str) else [spec], DMI_DIR)
        except (ValueError, TypeError) as err:
            problems.append(f"preemption.notices={spec!r}: {err}")
    if on_notice not in ON_NOTICE:
        problems.append(f"preemption.on_notice={on_notice!r} must be one of {ON_NOTICE}")
    if endpoint is not None and not str(endpoint).startswith(("http://", "https://")):
        problems.append(f"preemption.endpoint={endpoint!r} must be an http:// or https:// base URL")
    if not (math.isfinite(interval_s) and interval_s > 0):
        problems.append(f"preemption.poll_interval={interval_s!r}s must be a positive duration such as '5s'")
    return problems
