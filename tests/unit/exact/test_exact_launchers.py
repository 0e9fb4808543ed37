"""The launcher glue: SLURM job ids (array tasks too), ``scontrol requeue`` and its failures, and the
torchelastic launch that restarts unreliably."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from lightning_resume.exact.launchers import requeue, slurm_job_id, torchelastic_problem


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({"SLURM_JOB_ID": "4242"}, "4242"),
        ({"SLURM_JOB_ID": "4243", "SLURM_ARRAY_JOB_ID": "4200", "SLURM_ARRAY_TASK_ID": "7"}, "4200_7"),
        ({}, None),
        ({"SLURM_JOB_ID": "42; rm -rf /"}, None),
    ],
)
def test_the_job_id_scontrol_requeue_takes(environ: dict, expected: str) -> None:
    assert slurm_job_id(environ) == expected


def fake_scontrol(tmp_path: Path, exit_code: int) -> Path:
    """An ``scontrol`` first on PATH that records its arguments and exits with ``exit_code``."""
    calls = tmp_path / "calls.txt"
    script = tmp_path / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit {exit_code}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return calls


def test_requeue_runs_scontrol_once_with_the_array_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_scontrol(tmp_path, 0)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert requeue({"SLURM_JOB_ID": "4243", "SLURM_ARRAY_JOB_ID": "4200", "SLURM_ARRAY_TASK_ID": "7"})
    assert calls.read_text().splitlines() == ["requeue 4200_7"]


def test_a_failed_requeue_is_logged_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake_scontrol(tmp_path, 1)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with caplog.at_level(logging.WARNING):
        assert requeue({"SLURM_JOB_ID": "4242"}) is False
    assert "scontrol exited with 1; resubmit the job by hand" in caplog.text
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with caplog.at_level(logging.WARNING):
        assert requeue({"SLURM_JOB_ID": "4242"}) is False
    assert "cannot run scontrol" in caplog.text
    assert requeue({}) is False


def test_a_hung_scontrol_is_killed_after_the_timeout_and_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    script = tmp_path / "scontrol"  # a controller that never answers (exec: the kill reaches the sleep itself)
    pid_file = tmp_path / "scontrol.pid"
    script.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 100000\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with caplog.at_level(logging.WARNING):  # returns at all: scontrol alone would never end
        assert requeue({"SLURM_JOB_ID": "4242"}, timeout_s=0.5) is False
    with pytest.raises(ProcessLookupError):  # and the hung controller was killed, not left behind
        os.kill(int(pid_file.read_text()), 0)
    assert "job 4242 failed: `scontrol requeue 4242` did not finish within 0.5 s and was killed" in caplog.text


def test_torchelastic_restarts_on_a_shared_store_are_named() -> None:
    shared = {"TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    problem = torchelastic_problem(shared)
    assert problem is not None and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in problem
    assert torchelastic_problem(dict(shared, TORCHELASTIC_USE_AGENT_STORE="False")) is None
    assert torchelastic_problem(dict(shared, TORCHELASTIC_MAX_RESTARTS="0")) is None
    assert torchelastic_problem({}) is None
