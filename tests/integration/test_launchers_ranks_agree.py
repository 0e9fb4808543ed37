"""Ranks agree on the checkpoint they resume from, or all raise the same error at once (no hang).

Two nodes simulated as two DDP ranks, each with its own local checkpoint directory: only rank 0 writes
checkpoints, so on relaunch rank 0 resolves ``ckpt_path="last"`` to its file and rank 1 to nothing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import kill_resume as h
from tests.helpers.paths import free_port, job_script


def test_per_node_directories_make_every_rank_raise_the_same_named_error(tmp_path: Path) -> None:
    cfg = {"n": 40, "batch_size": 4, "max_steps": 4, "devices": 2, "ckpt_dir_per_rank": True,
           "ckpt": {"save_last": True, "every_n_train_steps": 2, "save_top_k": 0}}  # fmt: skip
    first = dict(cfg, out=str(tmp_path / "A"), ckpt_dir=str(tmp_path / "ckpt"))
    h.run(first, tmp_path)
    assert (tmp_path / "ckpt-rank0" / "last.ckpt").exists() and not (tmp_path / "ckpt-rank1").exists()
    again = dict(cfg, out=str(tmp_path / "B"), ckpt_dir=str(tmp_path / "ckpt"), resume="last", max_steps=8)
    # liveness only: ranks that waited for each other would block until the 300 s agreement timeout
    code = h.exit_code(again, tmp_path, timeout=240)
    output = h.output(again)
    assert code != 0, output
    for rank in (0, 1):  # the same error raised on both ranks (torch prefixes each rank's lines)
        assert f"[rank{rank}]: lightning_resume.errors.ResumeMismatchError" in output, output
        assert f"[rank{rank}]:   - rank 1: no checkpoint found: a fresh start" in output, output
    assert "rank 0: " in output and "last.ckpt (step 4)" in output


def test_a_rank_that_never_arrives_is_named_within_the_bound(tmp_path: Path) -> None:
    """Our agreement points never hang: a rank elsewhere (crashed, waiting in another collective) is named."""
    port, out = free_port(), tmp_path / "error.txt"
    procs = [
        subprocess.Popen([sys.executable, job_script("arrive_job.py"), str(rank), str(port), str(out)])
        for rank in (0, 1)
    ]
    try:
        assert procs[0].wait(timeout=240) == 0
    finally:
        for proc in procs:
            proc.kill()
    text = out.read_text()
    assert text.startswith("RanksOutOfStepError"), text
    seconds = float(text.split(" after ")[1].split("s:")[0])
    assert 2.5 < seconds < 20, text
    assert "rank 0" in text and "1" in text.split("within")[1], text
