"""botocore (under s3fs) draws the jitter of its retry backoff from Python's global ``random``.

``botocore/retryhandler.py`` ``delay_exponential`` (``random.random()``, legacy retry mode, s3fs's default)
and ``botocore/retries/standard.py`` ``ExponentialBackoff.__init__`` (``random=random.random``, standard
mode). One retried request (an upload on a writer thread, a ranged read, a listing) moved training's random
stream after ``ExactResume`` captured it, and a resumed run no longer continued the uninterrupted one bit
for bit. :func:`isolate_retry_jitter` gives botocore a generator of its own.
"""

from __future__ import annotations

import importlib
import random

_JITTER = random.Random()
"""botocore's own generator for the jitter of its retries."""


def isolate_retry_jitter() -> None:
    """Point botocore's retry jitter at a generator of its own (botocore 1.x: retryhandler.py
    ``delay_exponential``, retries/standard.py ``ExponentialBackoff``). Idempotent; a no-op without botocore.
    Called by ``ExactResume`` (which captures ``random``'s state) and by the retention mirror."""
    try:
        retryhandler = importlib.import_module("botocore.retryhandler")
        standard = importlib.import_module("botocore.retries.standard")
    except ImportError:
        return
    setattr(retryhandler, "random", _JITTER)  # noqa: B010 - replaces the module botocore imported; its only use: random()
    init = standard.ExponentialBackoff.__init__
    if init.__defaults__ is not None:
        init.__defaults__ = tuple(_JITTER.random if d is random.random else d for d in init.__defaults__)
