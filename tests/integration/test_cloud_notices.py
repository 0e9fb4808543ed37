"""Cloud preemption notices, for real: a metadata server on 127.0.0.1 speaks a cloud's documented API, fake
DMI files make ``preemption.notices="auto"`` pick that cloud, and the trainee (a fresh process) polls it.
Run A uninterrupted; run B gets a notice mid-epoch, writes a durable snapshot before the deadline and stops
cleanly; run C, a fresh process, resumes with ``fit(ckpt_path="last")`` and continues A bit for bit. Under
DDP only rank 1's metadata server announces the end, and both ranks stop at the same step."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.helpers import kill_resume as h
from tests.helpers.metadata import FakeMetadata, fake_dmi, serving

EXTENDED = frozenset(
    {
        "test_a_notice_mid_epoch_stops_after_a_durable_snapshot_and_the_relaunch_is_exact",
    }
)
"""In make test-all only: the DDP case does the same on two ranks (a notice, a durable snapshot, a clean stop
at the same step, a relaunch compared bitwise), against an AWS server instead of GCE."""

BASE = {
    "n": 40, "batch_size": 4, "max_epochs": 2, "dropout": 0.2, "augment": True, "shuffle": True, "slow": 0.08,
    "ckpt": {"save_top_k": 0},
}  # fmt: skip


def _exact(tmp_path: Path, endpoint: str, cloud: str, **schedule: Any) -> dict:
    preemption = {
        "notices": "auto",
        "endpoint": endpoint,
        "poll_interval": 0.05,
        "dmi_dir": fake_dmi(tmp_path / "dmi", cloud),
    }
    return {"preemption": preemption, "schedule": schedule}


def _announce_after(cfg: dict, steps: int, announce: Callable[[], None], ranks: int = 1) -> threading.Thread:
    """Announce the end once the run has trained ``steps`` micro-batches (polled from outside, like the cloud)."""

    def watch() -> None:
        deadline = time.monotonic() + 120
        while len(h.steps(cfg["out"], ranks - 1)) < steps and time.monotonic() < deadline:
            time.sleep(0.01)
        announce()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _gce_preempts(state: FakeMetadata) -> Callable[[], None]:
    def announce() -> None:
        state.gce_preempted = b"TRUE"

    return announce


def _aws_terminates(state: FakeMetadata) -> Callable[[], None]:
    def announce() -> None:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120))
        state.aws_action = json.dumps({"action": "terminate", "time": when}).encode()

    return announce


def test_a_notice_mid_epoch_stops_after_a_durable_snapshot_and_the_relaunch_is_exact(tmp_path: Path) -> None:
    with serving() as gce:
        cfg = {**BASE, "exact_args": _exact(tmp_path, gce.url, "gcp")}
        a = h.uninterrupted(cfg, tmp_path)
        assert gce.requests("preempted"), "A polled the metadata server (and was never told to stop)"
        b = dict(cfg, out=str(tmp_path / "B"), ckpt_dir=str(tmp_path / "B" / "ckpt"))
        watcher = _announce_after(b, 6, _gce_preempts(gce))
        h.run(b, tmp_path)  # a clean stop, exit code 0
        watcher.join()
    trained = len(h.steps(b["out"]))
    assert 6 <= trained < len(h.steps(a["out"])), "B stopped at the notice, before the end"
    out = h.output(b, tail=None)
    assert "gcp preemption notice" in out and "before the deadline" in out and "stopping" in out
    c = h.resumed({**BASE, "exact_args": {}}, tmp_path, b["ckpt_dir"])
    h.assert_exact_resume(a["out"], c["out"], resumed_after=trained)


@pytest.mark.slow
def test_under_ddp_a_notice_only_rank_1_sees_stops_both_ranks_at_the_same_step(tmp_path: Path) -> None:
    with serving() as quiet, serving() as aws:
        exact = _exact(tmp_path, aws.url, "aws", check_interval=0.3)
        cfg = {**BASE, "n": 80, "devices": 2, "exact_args": exact, "notice_endpoints": [quiet.url, aws.url]}
        a = h.uninterrupted(cfg, tmp_path)
        b = dict(cfg, out=str(tmp_path / "B"), ckpt_dir=str(tmp_path / "B" / "ckpt"))
        watcher = _announce_after(b, 6, _aws_terminates(aws), ranks=2)
        h.run(b, tmp_path)
        watcher.join()
        assert quiet.requests("instance-action") and not quiet.aws_action  # rank 0 polled and saw nothing
    trained = [len(h.steps(b["out"], r)) for r in range(2)]
    assert trained[0] == trained[1] and 6 <= trained[0] < len(h.steps(a["out"]))
    c = h.resumed({**BASE, "n": 80, "devices": 2, "exact_args": {}}, tmp_path, b["ckpt_dir"])
    h.assert_exact_resume(a["out"], c["out"], resumed_after=trained[0], ranks=2)
