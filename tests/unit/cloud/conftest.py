"""A fake metadata service on 127.0.0.1 speaking the three clouds' documented APIs, with state to flip.

AWS (IMDSv2 only: a GET without the current token is a 401, as on an instance with HttpTokens=required),
GCE (403 without ``Metadata-Flavor: Google``), Azure Scheduled Events (400 without ``Metadata: true`` or
with another api-version). ``hang_s`` makes every answer wait (released at teardown). Tests never reach
any other address: every poller is given ``endpoint=metadata.url``.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Callable, Iterator

import pytest

from lightning_resume.cloud.poller import THREAD_NAME, NoticePoller
from tests.helpers.metadata import NO_EVENTS, FakeMetadata, serving  # noqa: F401  (NO_EVENTS: for the tests)


@pytest.fixture
def metadata() -> Iterator[FakeMetadata]:
    with serving() as state:
        yield state


@pytest.fixture
def make_poller() -> Iterator[Callable[..., NoticePoller]]:
    """Pollers that are stopped at teardown; the test fails if a polling thread outlives it."""
    made: list[NoticePoller] = []

    def make(*args: object, **kwargs: object) -> NoticePoller:
        kwargs.setdefault("interval_s", 0.05)
        kwargs.setdefault("timeout_s", 0.5)
        poller = NoticePoller(*args, **kwargs)  # type: ignore[arg-type]
        made.append(poller)
        return poller

    yield make
    for poller in made:
        assert poller.stop(timeout=60), "a polling thread did not end"
    assert not [t for t in threading.enumerate() if t.name == THREAD_NAME]


@pytest.fixture
def caught() -> Iterator[list]:
    """Every warning emitted while the test runs, from any thread (the poller warns from its own)."""
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        yield records


def _wait_until(predicate: Callable[[], object], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


@pytest.fixture
def wait_until() -> Callable[..., None]:
    """``wait_until(predicate, timeout=60.0)``: poll until true, fail after ``timeout`` s (liveness only)."""
    return _wait_until
