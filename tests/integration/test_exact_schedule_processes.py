"""ExactResume's schedule across processes: rank 0's clock decides for every rank under 2-process DDP,
and a real SIGTERM yields a durable snapshot, a clean exit and a bitwise-exact resume."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.helpers import kill_resume as h
from tests.helpers import processes


def test_ddp_ranks_agree_on_rank0_clock(tmp_path: Path) -> None:
    script = tmp_path / "ddp_schedule.py"
    script.write_text(DDP_SCRIPT.format(out=str(tmp_path)))
    processes.run([script], timeout=240)
    lines = sorted((tmp_path / f"saves-{r}.txt").read_text() for r in range(2))
    assert lines[0] == lines[1] == "3,6,9,12\n"


DDP_SCRIPT = """
import os
import torch
torch.set_num_threads(1)
import lightning.pytorch as pl
from tests.helpers.callbacks import SpyTarget
from tests.helpers.jobs.trainee import Model
from lightning_resume import ExactResume, ScheduleOptions
from tests.helpers.clocks import with_clocks

class RankClock(pl.Callback):
    # rank 1's clock runs 3x faster: were it to decide, it would save at other steps
    def __init__(self): self.now = 0.0
    def __call__(self): return self.now
    def on_train_batch_end(self, trainer, *a): self.now += 10.0 * (1 + 2 * trainer.global_rank)

clock = RankClock()
spy = SpyTarget(os.path.join({out!r}, "ckpt"))
exact = with_clocks(ExactResume(mtbf="1h", schedule=ScheduleOptions(min_interval="30s", max_interval="30s")), clock=clock)
trainer = pl.Trainer(max_steps=12, accelerator="cpu", devices=2, strategy="ddp", logger=False,
    enable_progress_bar=False, enable_model_summary=False, callbacks=[clock, exact, spy],
    limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False)
trainer.fit(Model({{"out": {out!r}, "n": 200, "batch_size": 4, "devices": 2}}))
with open(os.path.join({out!r}, f"saves-{{trainer.global_rank}}.txt"), "w") as f:
    f.write(",".join(str(s) for s, _ in spy.saves) + "\\n")
if torch.distributed.is_initialized():  # gloo's threads end before the interpreter (else, at times, SIGABRT at exit)
    torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
def test_sigterm_gives_durable_snapshot_then_lightnings_exit_and_exact_resume(tmp_path: Path) -> None:
    cfg = {
        "n": 40,
        "batch_size": 4,
        "max_epochs": 2,
        "dropout": 0.2,
        "augment": True,
        "shuffle": True,
        "ckpt": {"save_top_k": 0},
        "slow": 0.15,
    }
    a = h.uninterrupted(cfg, tmp_path)
    b = dict(cfg, out=str(tmp_path / "B"), ckpt_dir=str(tmp_path / "B" / "ckpt"))
    # the snapshot is durable first; then Lightning's own SIGTERM handling goes on: fit raises SIGTERMException
    # (a SystemExit: exit code 0), so the script's code after fit does not run, as without the callback
    assert h.signal_after(b, tmp_path, signal.SIGTERM, after=6) == 0, h.output(b)
    assert not (tmp_path / "B" / "final.pt").exists()
    saved_step = h.snapshot_step(b["ckpt_dir"])
    assert len(h.steps(b["out"])) == saved_step  # stopped right after the snapshot: no work to redo
    c = h.resumed(cfg, tmp_path, b["ckpt_dir"])
    h.assert_exact_resume(a["out"], c["out"], resumed_after=saved_step)
