"""Domain exceptions of lightning-resume.

Every error a user can meet names the thing that is wrong and the fix. This module owns only the
exception types; it must not import Lightning or touch files.
"""

from __future__ import annotations

from typing import Iterable


class LightningResumeError(Exception):
    """Base class of every error raised by lightning-resume."""


class ConfigurationError(LightningResumeError, ValueError):
    """Invalid constructor arguments. Collects every problem before raising."""

    def __init__(self, owner: str, problems: Iterable[str]) -> None:
        self.owner = owner
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{owner}: invalid configuration:\n{lines}")


class ResumeMismatchError(LightningResumeError):
    """The checkpoint does not fit the current run, so an exact resume is impossible.

    ``differences`` lists what differs, one human-readable line each.
    """

    def __init__(self, source: str, differences: Iterable[str], hint: str) -> None:
        self.source = source
        self.differences = list(differences)
        self.hint = hint
        lines = "\n".join(f"  - {d}" for d in self.differences)
        super().__init__(f"cannot resume exactly from {source}:\n{lines}\n{hint}")


class CheckpointCorruptError(LightningResumeError):
    """A checkpoint file failed verification (truncated, flipped bytes, lying header...)."""

    def __init__(self, path: str, what: str, expected: object = None, actual: object = None) -> None:
        self.path = str(path)
        self.what = what
        self.expected = expected
        self.actual = actual
        detail = f" (expected {expected!r}, found {actual!r})" if expected is not None or actual is not None else ""
        super().__init__(f"{self.path}: {what}{detail}")


class UnsafeCheckpointError(LightningResumeError):
    """A checkpoint would need code execution (pickle globals) to load; it was refused."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: refused to load: {reason}")
