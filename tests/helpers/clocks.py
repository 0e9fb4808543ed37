"""The tests' seam for fake clocks: ``ExactResume`` takes none as an option (users never set one).

    exact = with_clocks(ExactResume(mtbf="1h"), clock=step_clock)

``clock`` is the monotonic clock the schedule measures intervals on; ``wall_clock`` (seconds since the epoch)
dates each checkpoint and the failure history. Either left ``None`` stays ``time``'s.
"""

from __future__ import annotations

from typing import Callable, Optional

from lightning_resume import ExactResume


def with_clocks(
    exact: ExactResume,
    clock: Optional[Callable[[], float]] = None,
    wall_clock: Optional[Callable[[], float]] = None,
) -> ExactResume:
    """``exact``, its schedule now read from ``clock`` and ``wall_clock`` (before the fit starts)."""
    exact._set_clocks(clock, wall_clock)
    return exact
