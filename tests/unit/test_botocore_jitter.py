"""A retried S3 request must not draw from Python's global ``random``, whose state ``ExactResume`` saves:
botocore takes its backoff jitter from it (legacy and standard retry modes) unless isolated."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

pytest.importorskip("botocore")

DRAWS = """
import random, sys
import botocore.retryhandler as legacy
import botocore.retries.standard as standard
if sys.argv[1] == "isolated":
    from lightning_resume import ExactResume
    ExactResume(mtbf=None)
random.seed(0)
before = random.getstate()
legacy.delay_exponential(base="rand", growth_factor=2, attempts=3)
standard.ExponentialBackoff().delay_amount(type("Ctx", (), {"attempt_number": 3})())
print(random.getstate() == before)
"""


def _unmoved(mode: str) -> bool:
    done = subprocess.run([sys.executable, "-c", DRAWS, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip() == "True"


def test_botocore_retry_jitter_moves_the_global_random_stream_unless_exact_resume_isolates_it() -> None:
    assert not _unmoved("plain")  # botocore's own behaviour: what the isolation is for
    assert _unmoved("isolated")


def test_isolation_is_idempotent_and_leaves_the_global_stream_alone() -> None:
    from lightning_resume._compat.botocore import isolate_retry_jitter

    isolate_retry_jitter()
    isolate_retry_jitter()
    import botocore.retryhandler as legacy

    state = random.getstate()
    legacy.delay_exponential(base="rand", growth_factor=2, attempts=2)
    assert random.getstate() == state
