"""What the launchers of large runs need from ``ExactResume``: SLURM requeue, torchelastic restarts.

SLURM: requeueing the job after its preemption snapshot is durable, as Lightning's SLURM environment does.

Lightning's own handler (lightning/pytorch/trainer/connectors/signal_connector.py:70-106) saves an
``hpc_ckpt_N.ckpt`` from inside the signal handler, in the middle of a step, then runs ``scontrol
requeue``. ``ExactResume`` takes that signal over (a flag, acted on at the next step boundary), so this
module does the second half once the snapshot is durable: the job id (array jobs as
``<array job>_<task>``) and the ``scontrol`` call, on rank 0 only, killed after ``REQUEUE_TIMEOUT_S``
(a hung controller must not hold the job past its grace time).

torchelastic: ``torchrun --max-restarts`` restarts the worker group in place. By default (torch >= 2.4)
the workers' process group shares the rendezvous' TCP store, which outlives an attempt: the restarted
group can read the addresses the dead attempt published and fail to connect, or hang, in
``init_process_group``. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives every attempt a fresh store;
``torchelastic_problem`` says so when it is missing.

Knows the launchers' environment variables and ``scontrol``, not Lightning.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from typing import Mapping, Optional

log = logging.getLogger(__name__)

REQUEUE_TIMEOUT_S = 30.0
"""How long ``scontrol requeue`` may take before it is killed. A healthy controller answers in well under a
second; a hung one must not hold the preempted job (every rank waits at the requeue barrier) until SLURM
kills it at the end of its grace time, unrequeued."""


def slurm_job_id(environ: Mapping[str, str]) -> Optional[str]:
    """The id ``scontrol requeue`` takes for this job: ``<array job>_<task>`` for an array task."""
    array_job, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    job = f"{array_job}_{task}" if array_job and task else environ.get("SLURM_JOB_ID")
    return job if job and re.fullmatch(r"[0-9_]+", job) else None


def requeue(environ: Optional[Mapping[str, str]] = None, *, timeout_s: float = REQUEUE_TIMEOUT_S) -> bool:
    """Run ``scontrol requeue <job id>``; ``True`` when it succeeded within ``timeout_s`` seconds (else it is
    killed). Failures are logged, never raised: the snapshot is already durable, and a job that is not
    requeued can be resubmitted by hand."""
    job = slurm_job_id(os.environ if environ is None else environ)
    if job is None:
        log.warning("SLURM requeue skipped: no valid SLURM_JOB_ID (or SLURM_ARRAY_JOB_ID/_TASK_ID) in the environment")
        return False
    command = ["scontrol", "requeue", job]
    try:
        code = subprocess.run(command, timeout=timeout_s).returncode  # on timeout: killed, then reaped
    except subprocess.TimeoutExpired:
        log.warning(
            f"SLURM requeue of job {job} failed: `{' '.join(command)}` did not finish within {timeout_s:g} s"
            " and was killed; resubmit the job by hand"
        )
        return False
    except OSError as err:
        log.warning(f"SLURM requeue of job {job} failed: cannot run scontrol ({err}); resubmit the job by hand")
        return False
    if code != 0:
        log.warning(f"SLURM requeue of job {job} failed: scontrol exited with {code}; resubmit the job by hand")
        return False
    log.info(f"requeued SLURM job {job}; it resumes from the durable snapshot")
    return True


def torchelastic_problem(environ: Mapping[str, str]) -> Optional[str]:
    """Why a restart of this torchelastic worker group may fail to reconnect, or ``None``."""
    restarts = environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    shared_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if not (restarts.isdigit() and int(restarts) > 0 and shared_store):
        return None
    return (
        f"torchrun restarts this group up to {restarts} times, but its workers share the rendezvous' TCP store,"
        " which keeps what the previous attempt published: a restarted group can fail to connect or hang in"
        " init_process_group. Launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and --rdzv-backend c10d"
        " (a fresh store per attempt); see the README's Launchers section"
    )
