"""The rolling file name of ``RetentionCheckpoint``: ``step=000000123.ckpt``.

Zero-padded so names sort by step, one file per step, never a ``-v1`` suffix. Pure string functions.
"""

from __future__ import annotations

import os
import re
from typing import Optional

STEP_DIGITS = 9
_ROLLING = re.compile(r"^step=([0-9]+)(\.[A-Za-z0-9]+)$")  # ASCII digits only: int() reads "١٠٠" too


def rolling_name(step: int, extension: str = ".ckpt") -> str:
    """The file name of this callback's checkpoint at ``step``: ``step=000000123.ckpt``."""
    return f"step={step:0{STEP_DIGITS}d}{extension}"


def parse_rolling_name(name: str, extension: str = ".ckpt") -> Optional[int]:
    """The step of a rolling file name, or ``None`` if ``name`` is not one of ours."""
    match = _ROLLING.match(os.path.basename(name))
    if match is None or match.group(2) != extension:
        return None
    return int(match.group(1))
