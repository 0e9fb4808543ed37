"""Retention per tier: what a run that mirrors its checkpoints keeps locally and in the mirror (pure).

A mirrored run writes every checkpoint to its local directory first and copies it to the mirror (an object
store, usually) in the background. Each tier has its own records and its own keep rules: the mirror, the
durable tier, keeps what the run's rules say (``keep_last``, ``keep_best``, anchors); the local tier keeps
its ``local_keep_last`` most recent (anchors are the mirror's to keep), or, without that setting, what the
same rules say. One protection is added to the local tier, and no setting overrides it: a local copy the
mirror does not have yet is never deleted. This module also decides when a failed upload is tried again
(exponential backoff, the clock passed in) and whether a new save must be uploaded before it counts as
done (``Mirror(anchors="sync")``), and holds :class:`Mirror`, the mirror's options. It must not import
Lightning, touch files or read the clock.
"""

import enum
from dataclasses import dataclass, replace
from typing import AbstractSet, Literal, Optional, Sequence

from lightning_resume.errors import ConfigurationError
from lightning_resume.retention.policy import ANCHOR, CheckpointRecord, KeepDecision, RetentionPolicy

NOT_ON_MIRROR = "protected: not on the mirror yet (kept until its upload is done)"


class AnchorUpload(str, enum.Enum):
    """When an anchor counts as saved: ``ASYNC``, once written locally (its upload follows in the background,
    like every other save); ``SYNC``, once the mirror has it too (the training thread waits for the upload)."""

    ASYNC = "async"
    SYNC = "sync"


MIRROR = "mirror."
"""How problems name the mirror's options: as ``RetentionCheckpoint``'s group ``mirror`` holds them."""


def local_keep_last_problems(local_keep_last: Optional[int]) -> list[str]:
    """Every problem with ``local_keep_last``, naming the option, the value and the fix."""
    if local_keep_last is None or (type(local_keep_last) is int and local_keep_last >= 1):
        return []
    return [
        f"{MIRROR}local_keep_last={local_keep_last!r} would delete the checkpoint being written; use >= 1"
        " (None keeps locally what the keep rules keep)"
    ]


@dataclass(frozen=True)
class Mirror:
    """Where and how ``RetentionCheckpoint`` mirrors its checkpoints: the second, durable tier.

    ``url``: any fsspec URL (``"s3://bucket/run"``) or another local directory. ``local_keep_last``: how many
    of the most recent checkpoints stay on local disk; ``None``: the local disk keeps what the keep rules say.
    ``anchors``: ``"async"``, an anchor counts as saved once written locally; ``"sync"``, once the mirror has
    it too (the save waits for its upload). Invalid values raise ``ConfigurationError`` naming each as
    ``mirror.<option>``, the name of this group in ``RetentionCheckpoint``.
    """

    url: str
    local_keep_last: Optional[int] = None
    anchors: Literal["async", "sync"] = "async"

    def __post_init__(self) -> None:
        problems = local_keep_last_problems(self.local_keep_last)
        if not isinstance(self.url, str) or not self.url.strip():
            problems.insert(0, f"{MIRROR}url={self.url!r} is not a location; use a URL such as 's3://bucket/run'")
        if self.anchors not in ("async", "sync"):
            problems.append(f"{MIRROR}anchors={self.anchors!r} is not supported; use 'async' or 'sync'")
        if problems:
            raise ConfigurationError("Mirror", problems)

    @property
    def anchor_upload(self) -> AnchorUpload:
        """``anchors`` as the enum the tier policy decides with."""
        return AnchorUpload(self.anchors)


@dataclass(frozen=True)
class TieredPolicy:
    """The keep rules of a mirrored run, one tier at a time.

    ``mirror``: the run's rules, applied to the mirror's records. ``local_keep_last``: how many of the most
    recent checkpoints stay on local disk; ``None``: the local tier follows ``mirror``'s rules too.
    """

    mirror: RetentionPolicy
    local_keep_last: Optional[int] = None

    def __post_init__(self) -> None:
        problems = local_keep_last_problems(self.local_keep_last)
        if problems:
            raise ConfigurationError("TieredPolicy", problems)

    @property
    def local(self) -> RetentionPolicy:
        """The rules of the local tier (protections aside)."""
        return self.mirror if self.local_keep_last is None else RetentionPolicy(keep_last=self.local_keep_last)

    def local_view(self, records: Sequence[CheckpointRecord]) -> list[CheckpointRecord]:
        """The local records as the local rules see them: with ``local_keep_last``, no record is an anchor
        locally (a permanent local anchor would fill the disk; the mirror keeps anchors)."""
        if self.local_keep_last is None:
            return list(records)
        return [replace(r, tags=r.tags - {ANCHOR}) if ANCHOR in r.tags else r for r in records]

    def decide_local(
        self,
        records: Sequence[CheckpointRecord],
        on_mirror: AbstractSet[str],
        resume_source: Optional[str] = None,
    ) -> list[KeepDecision]:
        """One decision per local record, oldest first: the local rules, and a record whose name is not in
        ``on_mirror`` (the base names the mirror holds, verified) is kept whatever they say."""
        by_path = {r.path: r for r in records}
        decisions = []
        for decision in self.local.decide(self.local_view(records), resume_source):
            record = by_path[decision.record.path]
            if not decision.keep and _name(record.path) not in on_mirror:
                decision = KeepDecision(record, True, (NOT_ON_MIRROR,))
            decisions.append(KeepDecision(record, decision.keep, decision.reasons))
        return decisions

    def local_anchors(self, records: Sequence[CheckpointRecord]) -> list[CheckpointRecord]:
        """The local records the local rules treat as anchors (none with ``local_keep_last``)."""
        return self.local.anchors(self.local_view(records))

    def decide_mirror(
        self, records: Sequence[CheckpointRecord], resume_source: Optional[str] = None
    ) -> list[KeepDecision]:
        """One decision per mirror record, oldest first: the run's rules and every protection of ``policy``."""
        return self.mirror.decide(records, resume_source)

    def upload_first(
        self, mirror_records: Sequence[CheckpointRecord], new: CheckpointRecord, anchors: AnchorUpload
    ) -> bool:
        """Whether the save ``new`` must reach the mirror before it counts as done: with ``SYNC``, when it
        becomes an anchor of the mirror once uploaded."""
        if anchors is not AnchorUpload.SYNC:
            return False
        landed = replace(new, verified=True, in_flight=False)
        return any(r.path == new.path for r in self.mirror.anchors([*mirror_records, landed]))


@dataclass(frozen=True)
class UploadRetry:
    """When a failed upload is tried again: ``base_s`` after the first failure, doubling per failure up to
    ``max_s``. Never given up: the local copy is kept until the mirror has it."""

    base_s: float = 5.0
    max_s: float = 600.0

    def delay(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failure in a row (``failures >= 1``)."""
        return min(self.max_s, self.base_s * 2.0 ** max(0, failures - 1))

    def due(self, failures: int, failed_at: float, now: float) -> bool:
        """Whether an upload that failed ``failures`` times, last at ``failed_at``, may be tried at ``now``."""
        return now >= failed_at + self.delay(failures)


def _name(path: str) -> str:
    """The base name of a path or URL: what identifies one checkpoint across tiers."""
    return str(path).rstrip("/").rsplit("/", 1)[-1]
