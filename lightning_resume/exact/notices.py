"""Cloud preemption notices in a Lightning run: each rank's poller, the level it asks for, what is logged.

Spot and preemptible instances announce their end (AWS two minutes ahead, Google Compute Engine about 30 s,
Azure's scheduled events with a ``NotBefore``); ``cloud.NoticePoller`` watches the documented metadata
endpoint of the cloud this machine is on, off the training thread. Here a notice becomes a preemption level
the ranks agree on at their next check, exactly as a preemption signal does (``driver.at_step_boundary``):
``STOP`` (a durable snapshot, then a clean stop) or, with ``on_notice="snapshot"`` and for advisory notices
(AWS's rebalance recommendation), ``SNAPSHOT`` (a durable snapshot, training goes on); the poller hands out
an advisory once per episode (``cloud.episodes``), so one that flaps costs one snapshot. When the measured
cost of a durable save does not fit in the time the notice leaves, that is said at once. This module holds
the glue and the log lines; the polling is ``lightning_resume.cloud``'s, the decision the driver's.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Optional, Sequence

from lightning_resume.cloud import Notice, NoticePoller, resolve_clouds
from lightning_resume.cloud.detect import DMI_DIR
from lightning_resume.errors import ConfigurationError
from lightning_resume.schedule.options import NoticeSpec, notice_problems

log = logging.getLogger("lightning_resume.notices")

SNAPSHOT, STOP, REQUEUE = 1, 2, 3
"""Preemption levels agreed over ranks (the highest wins): save a durable snapshot and go on; stop after a
durable snapshot; also requeue the SLURM job."""


class NoticeWatch:
    """One process's watch: started at train start, stopped at its end; asks for a level at step boundaries."""

    def __init__(
        self,
        spec: NoticeSpec,
        on_notice: str = "stop",
        endpoint: Optional[str] = None,
        dmi_dir: str = DMI_DIR,
        interval_s: float = 5.0,
        timeout_s: float = 2.0,
    ) -> None:
        problems = notice_problems(spec, on_notice, endpoint, interval_s)
        if problems:
            raise ConfigurationError("ExactResume", problems)
        self.spec = "auto" if spec == "auto" else tuple([spec] if isinstance(spec, str) else spec or ())
        self.on_notice, self.endpoint, self.dmi_dir = on_notice, endpoint, dmi_dir
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.poller: Optional[NoticePoller] = None
        self._handled: Optional[Notice] = None  # the preempt notice already acted on (on_notice="snapshot")
        self._announced = False
        self.clouds: tuple[str, ...] = ()

    def start(self, wall_clock: Callable[[], float]) -> tuple[str, ...]:
        """Start polling the clouds the spec names (``"auto"``: the one this machine's DMI evidence shows, if
        any); return them. Nothing starts, and no socket opens, when there is none."""
        self.stop()
        self.clouds = tuple(resolve_clouds(self.spec, self.dmi_dir))
        self._handled, self._announced = None, False
        if self.clouds:
            self.poller = NoticePoller(
                self.clouds, endpoint=self.endpoint, interval_s=self.interval_s, timeout_s=self.timeout_s,
                wall_clock=wall_clock,
            )  # fmt: skip
            self.poller.start()
        return self.clouds

    def stop(self) -> None:
        if self.poller is not None:
            self.poller.stop()
            self.poller = None

    def level(self, now: float, durable_cost_s: Optional[float]) -> int:
        """What this rank asks for at this step boundary (0: nothing). The first time a preempt notice is seen
        it is logged, with a warning when ``durable_cost_s`` (the measured time to a durable save) does not
        fit in the time left before its deadline."""
        if self.poller is None:
            return 0
        notice = self.poller.notice
        if notice is not None and notice is not self._handled:
            if not self._announced:
                self._announced = True
                _announce(notice, now, durable_cost_s)
            return STOP if self.on_notice == "stop" else SNAPSHOT
        advisory = self.poller.take_advisory()
        if advisory is not None:
            log.warning(
                "ExactResume: %s advisory notice (%s): taking a durable snapshot", advisory.cloud, advisory.detail
            )
            return SNAPSHOT
        return 0

    def snapshot_taken(self) -> None:
        """``on_notice="snapshot"``: the snapshot for the current notice is durable; training goes on until
        the signal comes (the notice is not acted on again)."""
        if self.poller is not None:
            self._handled = self.poller.notice

    @property
    def deadline(self) -> Optional[float]:
        notice = self.poller.notice if self.poller is not None else None
        return None if notice is None else notice.deadline


def _announce(notice: Notice, now: float, durable_cost_s: Optional[float]) -> None:
    left = None if notice.deadline is None else notice.deadline - now
    when = "no deadline given" if left is None else f"{left:.1f} s before its deadline"
    log.warning(
        "ExactResume: %s preemption notice (%s), %s: durable snapshot at the next step boundary",
        notice.cloud, notice.detail, when,
    )  # fmt: skip
    if left is not None and durable_cost_s is not None and durable_cost_s > left:
        log.warning(
            "ExactResume: a durable save took %.1f s so far, more than the %.1f s the %s notice leaves: it may not"
            " finish before the instance goes (the memory tier does not outlive the instance); shorten saves"
            " (save='async', a faster store) or take scheduled snapshots more often",
            durable_cost_s, max(left, 0.0), notice.cloud,
        )  # fmt: skip


def margin_metrics(deadlines: Sequence[Any], started: float, durable: float) -> dict[str, float]:
    """The logged figures of a save made for a notice: its time to durable, and the margin left before the
    earliest deadline any rank saw (wall-clock seconds)."""
    known = [float(d) for d in deadlines if isinstance(d, (int, float)) and math.isfinite(d)]
    metrics = {"preemption_notice/save_s": durable - started}
    if known:
        metrics["preemption_notice/margin_s"] = min(known) - durable
    return metrics
