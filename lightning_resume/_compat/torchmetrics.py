"""The private names of torchmetrics ``Metric`` that a faithful restore of a metric needs (torchmetrics 1.9).

A metric's states are public attributes (``metric_state``) and its update count is a public read-only
property (``update_count``); setting the count back has no public way. Nothing else of torchmetrics'
internals is used: the cached ``compute()`` value is a function of the states, so it is recomputed, equal.
"""

from __future__ import annotations

from typing import Any

from torchmetrics import Metric


def set_update_count(metric: Metric, count: int) -> None:
    """Put back how many times ``update`` ran since the last reset (metric.py:162, read by ``update_count``
    at :194): ``compute()`` warns when it is 0 and full-state ``forward`` averages with it (:481)."""
    metric._update_count = int(count)


def invalidate_cache(metric: Metric) -> None:
    """Drop the cached ``compute()`` value (metric.py:160, set at :704), which the restored states supersede."""
    metric._computed = None


def is_metric(value: Any) -> bool:
    return isinstance(value, Metric)
