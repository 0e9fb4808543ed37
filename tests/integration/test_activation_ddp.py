"""DDP on 2 CPU processes (gloo): activation checkpointing changes neither losses nor weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import processes
from tests.helpers.paths import job_script


def run_job(out: Path, mode: str) -> dict:
    processes.run([job_script("activation_ddp_job.py"), out, mode], timeout=180)
    return torch.load(out, weights_only=True)


@pytest.mark.slow
def test_ddp_two_processes_bitwise_equal_on_and_off(tmp_path):
    on = run_job(tmp_path / "on.pt", "on")
    off = run_job(tmp_path / "off.pt", "off")
    assert on["checkpointed"] == ["layers"] and off["checkpointed"] == []  # sqrt(4): two segments in layers
    assert len(on["losses"]) == 4 and torch.equal(on["losses"], off["losses"])
    assert list(on["state"]) == list(off["state"])
    assert all(torch.equal(on["state"][k], off["state"][k]) for k in on["state"])
