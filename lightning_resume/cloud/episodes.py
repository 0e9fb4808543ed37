"""When an advisory notice is a new announcement, and when it is the one already acted on: a pure policy.

An advisory (AWS's rebalance recommendation, GCE's live migration) asks for one durable snapshot. An
endpoint that flaps (answers it, then "nothing", then it again, poll after poll) or that changes its
notice time at every answer must not turn one announcement into a snapshot per poll. So advisories are
grouped into episodes, per endpoint, and only the first answer of an episode is handed out:

- the first advisory an endpoint answers begins an episode;
- an advisory after the endpoint showed none for ``quiet_s`` begins a new one (GCE announces every
  migration with the same text: only the quiet between them tells two apart);
- a different announcement (another notice time) begins a new one only once ``quiet_s`` has passed since
  the episode began; until then it belongs to the current one (a flapping endpoint costs at most one
  snapshot per ``quiet_s``);
- anything else continues the current episode.

Nothing here reads a clock: ``now`` (monotonic seconds) is passed in by the poller.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

ADVISORY_QUIET_S = 600.0
"""How long an endpoint must show no advisory before the next one is a new episode, and the least time
between two episodes of one endpoint."""


@dataclass(frozen=True)
class Episode:
    """One advisory episode of one endpoint: the announcement that began it (``detail``), when it began, and
    when an advisory was last answered."""

    detail: str
    began: float
    last_seen: float


def next_episode(
    current: Optional[Episode], detail: Optional[str], now: float, quiet_s: float = ADVISORY_QUIET_S
) -> tuple[Optional[Episode], bool]:
    """The episode after an answer announcing ``detail`` (``None``: no advisory) at ``now``, and whether this
    answer begins a new episode (then, and only then, the advisory is handed out)."""
    if detail is None:
        return current, False
    if current is None or now - current.last_seen >= quiet_s:
        return Episode(detail, now, now), True
    if detail != current.detail and now - current.began >= quiet_s:
        return Episode(detail, now, now), True
    return replace(current, last_seen=now), False
