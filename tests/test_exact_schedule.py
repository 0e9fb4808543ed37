"""ExactResume's schedule in a real fit: snapshots at the computed times (fake clock), agreed by
rank 0 under 2-process DDP, and a real SIGTERM that yields a durable snapshot, a clean exit and a
bitwise-exact resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_resume import ConfigurationError, ExactResume, young_interval
from tests.exact import harness as h
from tests.exact.trainee import Model


class StepClock(Callback):
    """A fake monotonic clock: 10 seconds per training batch, advanced before ExactResume looks."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def on_train_batch_end(self, *args) -> None:
        self.now += 10.0


class SpyTarget(ModelCheckpoint):
    """A snapshot target that records when it was asked to save."""

    accepts_snapshots = True

    def __init__(self, dirpath: str) -> None:
        super().__init__(dirpath=dirpath, save_top_k=0)
        self.saves: list[tuple[int, str]] = []

    def save_snapshot(self, trainer: pl.Trainer, reason: str) -> str:
        self.saves.append((trainer.global_step, reason))
        path = os.path.join(str(self.dirpath), f"snap-{trainer.global_step}.ckpt")
        trainer.save_checkpoint(path)
        return path


def _fit(tmp_path: Path, exact: ExactResume, clock: StepClock, target: ModelCheckpoint, steps: int = 20) -> None:
    cfg = {"out": str(tmp_path), "n": 200, "batch_size": 4}
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[clock, exact, target], num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(Model(cfg))


def test_snapshots_follow_the_clamped_interval(tmp_path: Path) -> None:
    clock, target = StepClock(), SpyTarget(str(tmp_path / "ckpt"))
    exact = ExactResume(mtbf="1h", min_interval="30s", max_interval="30s", clock=clock)
    _fit(tmp_path, exact, clock, target)
    # 10 s per step, T* clamped to 30 s: the first save measures C at min_interval, then every 30 s.
    assert [s for s, _ in target.saves] == [3, 6, 9, 12, 15, 18]
    assert target.saves[0][1] == "first_measurement" and {r for _, r in target.saves[1:]} == {"interval"}


def test_interval_is_young_of_measured_cost(tmp_path: Path) -> None:
    clock, target = StepClock(), SpyTarget(str(tmp_path / "ckpt"))
    exact = ExactResume(mtbf="2h", min_interval="10s", max_interval="1h", clock=clock)
    _fit(tmp_path, exact, clock, target, steps=40)
    state = exact.scheduler.state
    c = sorted(state.costs)[len(state.costs) // 2]
    t_star = max(young_interval(c, 7200.0), 10.0)
    steps = [s for s, _ in target.saves]
    gaps = {b - a for a, b in zip(steps[1:], steps[2:])}
    # the wall cost of a save on this machine is milliseconds: T* is a few seconds, i.e. one 10 s step
    assert gaps == {max(1, int(-(-t_star // 10)))}, (steps, t_star)


def test_step_cap_and_off(tmp_path: Path) -> None:
    clock, target = StepClock(), SpyTarget(str(tmp_path / "ckpt"))
    _fit(tmp_path, ExactResume(every_n_train_steps_max=7, clock=clock), clock, target)
    assert [s for s, _ in target.saves] == [7, 14]
    assert not ExactResume().scheduler.takes_snapshots  # mtbf=None: no scheduled snapshots, only preemption checks
    assert ExactResume(preemption_signals=None).scheduler is None


def test_schedule_arguments_are_validated_together() -> None:
    with pytest.raises(ConfigurationError) as err:
        ExactResume(mtbf="soon", min_interval="-1s", every_n_train_steps_max=0)
    text = str(err.value)
    assert "mtbf='soon'" in text and "every_n_train_steps_max=0" in text


def test_fallback_snapshots_are_found_by_last(tmp_path: Path) -> None:
    clock = StepClock()
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=0)
    _fit(tmp_path, ExactResume(every_n_train_steps_max=5, clock=clock), clock, ckpt, steps=12)
    snaps = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("last-snapshot"))
    assert snaps == ["last-snapshot-step=000000010.ckpt"]  # the older one removed after the newer was written
    assert ckpt._find_last_checkpoints(pl.Trainer(logger=False)) == {str(tmp_path / "ckpt" / snaps[0])}


def test_ddp_ranks_agree_on_rank0_clock(tmp_path: Path) -> None:
    script = tmp_path / "ddp_schedule.py"
    script.write_text(DDP_SCRIPT.format(root=str(h.ROOT), out=str(tmp_path)))
    proc = subprocess.run([sys.executable, str(script)], env=h._env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = sorted((tmp_path / f"saves-{r}.txt").read_text() for r in range(2))
    assert lines[0] == lines[1] == "3,6,9,12\n"


DDP_SCRIPT = """
import os, sys
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads(1)
import lightning.pytorch as pl
from tests.test_exact_schedule import SpyTarget
from tests.exact.trainee import Model
from lightning_resume import ExactResume

class RankClock(pl.Callback):
    # rank 1's clock runs 3x faster: were it to decide, it would save at other steps
    def __init__(self): self.now = 0.0
    def __call__(self): return self.now
    def on_train_batch_end(self, trainer, *a): self.now += 10.0 * (1 + 2 * trainer.global_rank)

clock = RankClock()
spy = SpyTarget(os.path.join({out!r}, "ckpt"))
exact = ExactResume(mtbf="1h", min_interval="30s", max_interval="30s", clock=clock)
trainer = pl.Trainer(max_steps=12, accelerator="cpu", devices=2, strategy="ddp", logger=False,
    enable_progress_bar=False, enable_model_summary=False, callbacks=[clock, exact, spy],
    limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False)
trainer.fit(Model({{"out": {out!r}, "n": 200, "batch_size": 4, "devices": 2}}))
with open(os.path.join({out!r}, f"saves-{{trainer.global_rank}}.txt"), "w") as f:
    f.write(",".join(str(s) for s, _ in spy.saves) + "\\n")
"""


def test_sigterm_gives_durable_snapshot_clean_exit_and_exact_resume(tmp_path: Path) -> None:
    cfg = {"n": 40, "batch_size": 4, "max_epochs": 2, "dropout": 0.2, "augment": True, "shuffle": True,
           "ckpt": {"save_top_k": 0}, "slow": 0.15}
    a = dict(cfg, out=str(tmp_path / "A"), ckpt_dir=str(tmp_path / "A" / "ckpt"))
    h.run(a, tmp_path)
    b = dict(cfg, out=str(tmp_path / "B"), ckpt_dir=str(tmp_path / "B" / "ckpt"))
    proc = h._start(b, tmp_path)
    deadline = time.monotonic() + 120
    while len(h.steps(b["out"])) < 6 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, h._output(b)
    snaps = list(Path(b["ckpt_dir"]).glob("last-snapshot-step=*.ckpt"))
    assert len(snaps) == 1, h._output(b)
    saved_step = torch.load(snaps[0], weights_only=True)["global_step"]
    assert len(h.steps(b["out"])) == saved_step  # stopped right after the snapshot: no work to redo
    c = dict(cfg, out=str(tmp_path / "C"), ckpt_dir=b["ckpt_dir"], resume="last")
    h.run(c, tmp_path)
    h.assert_exact_resume(a["out"], c["out"], resumed_after=saved_step)


class Recorder(pl.loggers.Logger):
    """A logger that keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.rows.append((step, dict(metrics)))


def test_each_snapshot_logs_its_health_metrics(tmp_path: Path) -> None:
    clock, recorder = StepClock(), Recorder()
    target = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=0)
    trainer = pl.Trainer(
        max_steps=9, accelerator="cpu", logger=recorder, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[clock, ExactResume(mtbf="1h", min_interval="30s", max_interval="30s", clock=clock), target],
        limit_val_batches=0, log_every_n_steps=1000,
    )
    trainer.fit(Model({"out": str(tmp_path), "n": 200, "batch_size": 4}))
    rows = [(s, m) for s, m in recorder.rows if "ckpt/blocked_s" in m]
    assert [s for s, _ in rows] == [3, 6, 9]
    metrics = rows[-1][1]
    assert metrics["ckpt/interval_s"] == 30.0 and metrics["ckpt/mtbf_s"] == 3600.0
    assert metrics["ckpt/bytes"] == os.path.getsize(tmp_path / "ckpt" / "last-snapshot-step=000000009.ckpt")
    assert 0 < metrics["ckpt/blocked_s"] < 60 and 0 < metrics["ckpt/expected_waste"] < 1
    assert metrics["ckpt/cost_s"] > 0 and metrics["ckpt/write_MBps"] > 0


def test_observed_mtbf_learns_from_restarts(tmp_path: Path) -> None:
    """Each resume appends to resume_history.json; mtbf="observed" turns failures into a shorter M."""
    from lightning_resume.failures import history_path, load_history

    ckpt = tmp_path / "ckpt"
    for run, steps in enumerate((6, 12, 18)):
        clock = StepClock()
        exact = ExactResume(mtbf="observed", mtbf_prior="1000h", every_n_train_steps_max=3, clock=clock)
        trainer = pl.Trainer(
            max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0,
            callbacks=[clock, exact, ModelCheckpoint(dirpath=str(ckpt), save_top_k=0)],
        )
        if run:  # the previous "process" died: its clean stop is not in the history
            path = Path(history_path(str(ckpt)))
            path.write_text(json.dumps(dict(json.loads(path.read_text()), clean_stop_time=None)))
        trainer.fit(Model({"out": str(tmp_path), "n": 200, "batch_size": 4}), ckpt_path="last" if run else None)
    history = load_history(history_path(str(ckpt)))
    assert len(history.events) == 2 and len(history.failures) == 2
    assert exact.scheduler.state.mtbf_s < 1000 * 3600 / 2  # two failures in seconds of uptime: M far below the prior


def test_default_retention_checkpoint_keeps_its_topk_untouched(tmp_path: Path) -> None:
    """RetentionCheckpoint with default arguments is ModelCheckpoint: snapshots go beside its files."""
    from lightning_resume import RetentionCheckpoint

    clock = StepClock()
    topk = RetentionCheckpoint(dirpath=str(tmp_path / "ckpt"), monitor="val_loss", save_top_k=2)
    trainer = pl.Trainer(
        max_steps=20, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[clock, ExactResume(every_n_train_steps_max=3, clock=clock), topk],
        val_check_interval=10, limit_val_batches=2, num_sanity_val_steps=0,
    )
    trainer.fit(Model({"out": str(tmp_path), "n": 80, "batch_size": 4, "val_check_interval": 10}))
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.suffix == ".ckpt")
    assert len(topk.best_k_models) == 2 and all("last-snapshot" not in p for p in topk.best_k_models)
    assert [n for n in names if n.startswith("last-snapshot")] == ["last-snapshot-step=000000018.ckpt"]
    assert not any(n.startswith("step=") for n in names)


def test_signal_handlers_are_given_back_when_fit_fails(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)

    class Boom(Model):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    trainer = pl.Trainer(
        max_steps=5, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ExactResume(), ModelCheckpoint(dirpath=str(tmp_path / "ckpt"))], limit_val_batches=0,
    )
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Boom({"out": str(tmp_path), "n": 40, "batch_size": 4}))
    assert signal.getsignal(signal.SIGTERM) is before
