"""Durations given by users: ``timedelta``, seconds, or strings such as ``"24h"`` or ``"1h30m"``.

Parsed once, at construction, into seconds (float). No clock reads here.
A ten-line grammar: the standard library has no parser for it and jsonargparse passes strings through.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Union

Duration = Union[str, int, float, timedelta]

_UNITS = {"ms": 1e-3, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|sec|s|min|m|h|d|w)", re.IGNORECASE)


def parse_duration(value: Duration, name: str = "duration") -> float:
    """Return ``value`` in seconds. Raises ``ValueError`` naming ``name`` and the accepted forms."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not a duration; use seconds, a timedelta or a string like '24h'")
    if isinstance(value, (int, float)):
        return float(value)
    text = str(value).strip().replace(" ", "")
    if re.fullmatch(r"\d+(?:\.\d+)?", text):
        return float(text)
    parts = _PART.findall(text)
    if not parts or "".join(n + u for n, u in parts).lower() != text.lower():
        raise ValueError(
            f"{name}={value!r} is not a duration; use seconds, a timedelta or a string like '24h', '30min', '1h30m'"
        )
    return sum(float(n) * _UNITS[u.lower()] for n, u in parts)
