"""The failure history on ``s3://`` (moto server on 127.0.0.1): each restart reads what the last one wrote."""

from __future__ import annotations

import fsspec
import pytest

from lightning_resume.schedule.history import (
    HISTORY_FILENAME,
    estimate_mtbf,
    history_path,
    load_history,
    record_start,
    save_history,
)

pytestmark = pytest.mark.timeout(120)


def test_history_on_s3_accumulates_failures_across_restarts(s3_bucket: str) -> None:
    path = history_path(f"{s3_bucket}/run")
    assert path == f"{s3_bucket}/run/{HISTORY_FILENAME}"  # the scheme is kept
    h = record_start(load_history(path), now=1000.0, checkpoint_time=None)
    assert save_history(path, h)
    for now, ckpt in ((4600.0, 4000.0), (9000.0, 8000.0)):  # two restarts after failures
        h = record_start(load_history(path), now=now, checkpoint_time=ckpt)
        assert save_history(path, h)
    loaded = load_history(path)
    assert loaded == h and len(loaded.failures) == 2
    assert fsspec.filesystem("s3").exists(path)
    # observed MTBF learns from S3: far below a 1e6 s prior after two failures in ~9000 s
    assert estimate_mtbf(loaded, prior_mtbf_s=1e6, prior_weight=1.0, now=9000.0) < 1e6
