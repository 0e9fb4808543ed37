"""A pytest plugin that adds ``ExactResume()`` to every ``lightning.pytorch.Trainer``'s callbacks.

Owns the injection only: ``Trainer.__init__`` is wrapped once at ``pytest_configure`` so that
Lightning's own tests run unchanged, and each test records how many Trainers it built (a junit
property), so that a regression in a test that built none can be told apart. Loaded with
``-p inject`` by ``run.py``; it must not change anything else (no warning filters, no fixtures).
A Trainer built in a child process that starts a fresh interpreter (a script run with
``subprocess``) is not reached; ``ddp_spawn`` children get the Trainer the parent built.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

PROPERTY = "exact_resume_trainers"
_built = [0]  # Trainers built during the current test (a list, so the wrapper can count without `global`)


def _with_exact_resume(callbacks: Any) -> list[Any]:
    """The callbacks the test gave, as a new list (the test's own list is left as it is), plus one
    ``ExactResume()`` unless the test already passed one."""
    from lightning_resume import ExactResume

    given = [] if callbacks is None else list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    if not any(isinstance(cb, ExactResume) for cb in given):
        given.append(ExactResume())
    return given


def _patch_trainer() -> None:
    from lightning.pytorch.trainer.trainer import Trainer

    original = Trainer.__init__
    if getattr(original, "__exact_resume_injected__", False):
        return

    @functools.wraps(original)
    def __init__(self: Trainer, *args: Any, **kwargs: Any) -> None:
        # Trainer's parameters are keyword-only, so `callbacks` is always in kwargs when given.
        kwargs["callbacks"] = _with_exact_resume(kwargs.get("callbacks"))
        _built[0] += 1
        original(self, *args, **kwargs)

    __init__.__exact_resume_injected__ = True  # type: ignore[attr-defined]
    Trainer.__init__ = __init__  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    import lightning_resume

    _ = lightning_resume.ExactResume  # imported now: a broken package stops the run at start, not in every test
    _patch_trainer()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> object:
    """Count the Trainers the test body builds (fixtures' are not counted); recorded even when it fails."""
    _built[0] = 0
    try:
        return (yield)
    finally:
        item.user_properties.append((PROPERTY, _built[0]))
