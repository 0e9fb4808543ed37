"""ExactResume's schedule in a real fit, in this process: snapshots at the computed times (fake clock),
health metrics, the observed MTBF, and signal handlers given back. The 2-process DDP agreement and the
real SIGTERM are in tests/integration/test_exact_schedule_processes.py."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_resume import ConfigurationError, ExactResume, MemoryTierOptions, ScheduleOptions, young_interval
from tests.helpers.callbacks import SpyTarget
from tests.helpers.clocks import with_clocks
from tests.helpers.jobs.trainee import Model
from tests.helpers.models import tiny_trainer


class StepClock(Callback):
    """A fake monotonic clock: 10 seconds per training batch, advanced before ExactResume looks, and
    ``save_cost`` seconds per checkpoint written."""

    def __init__(self, save_cost: float = 0.0) -> None:
        self.now = 0.0
        self.save_cost = save_cost

    def on_save_checkpoint(self, *args) -> None:
        self.now += self.save_cost

    def __call__(self) -> float:
        return self.now

    def on_train_batch_end(self, *args) -> None:
        self.now += 10.0


def _fit(
    tmp_path: Path,
    callbacks: list,
    steps: int = 20,
    model: type = Model,
    ckpt_path=None,
    n: int = 200,
    **trainer_kwargs,
) -> None:
    """Fit the trainee's ``model`` for ``steps`` steps of batch 4 over ``n`` samples, without validation unless
    ``val_check_interval`` is given (the model then has a validation loader)."""
    trainer = tiny_trainer(callbacks, max_steps=steps, **{"limit_val_batches": 0, **trainer_kwargs})
    val = trainer_kwargs.get("val_check_interval")
    trainer.fit(model({"out": str(tmp_path), "n": n, "batch_size": 4, "val_check_interval": val}), ckpt_path=ckpt_path)


def test_snapshots_follow_the_clamped_interval(tmp_path: Path) -> None:
    clock, target = StepClock(), SpyTarget(str(tmp_path / "ckpt"))
    exact = with_clocks(
        ExactResume(mtbf="1h", schedule=ScheduleOptions(min_interval="30s", max_interval="30s")), clock=clock
    )
    _fit(tmp_path, [clock, exact, target])
    # 10 s per step, T* clamped to 30 s: the first save measures C at min_interval, then every 30 s.
    assert [s for s, _ in target.saves] == [3, 6, 9, 12, 15, 18]
    assert target.saves[0][1] == "first_measurement" and {r for _, r in target.saves[1:]} == {"interval"}


def test_interval_is_young_of_measured_cost(tmp_path: Path) -> None:
    clock, target = StepClock(save_cost=2.0), SpyTarget(str(tmp_path / "ckpt"))
    exact = with_clocks(
        ExactResume(mtbf="2h", schedule=ScheduleOptions(min_interval="10s", max_interval="1h")), clock=clock
    )
    _fit(tmp_path, [clock, exact, target], steps=40)
    assert exact.scheduler.state.costs and set(exact.scheduler.state.costs) == {2.0}  # measured on the run's clock
    t_star = young_interval(2.0, 7200.0)  # 169.7 s: 17 steps of 10 s
    steps = [s for s, _ in target.saves]
    assert [b - a for a, b in zip(steps[1:], steps[2:])] == [17] * (len(steps) - 2), (steps, t_star)
    assert len(steps) >= 3


def test_step_cap_and_off(tmp_path: Path) -> None:
    clock, target = StepClock(), SpyTarget(str(tmp_path / "ckpt"))
    _fit(
        tmp_path,
        [
            clock,
            with_clocks(ExactResume(mtbf=None, schedule=ScheduleOptions(every_n_train_steps_max=7)), clock=clock),
            target,
        ],
    )
    assert [s for s, _ in target.saves] == [7, 14]
    assert not ExactResume(mtbf=None).scheduler.takes_snapshots  # no scheduled snapshots, only preemption checks
    assert ExactResume(mtbf=None, preemption=None).scheduler is None


def test_the_default_is_the_observed_schedule_with_the_documented_prior(tmp_path: Path) -> None:
    clock, target = StepClock(), SpyTarget(str(tmp_path / "ckpt"))
    exact = with_clocks(ExactResume(), clock=clock)
    assert exact.scheduler.config.mtbf_mode.value == "observed" and exact.scheduler.config.mtbf_s == 30 * 86400
    _fit(tmp_path, [clock, exact, target])
    # 10 s per step: the first save measures C at min_interval (1 min); a save costs nothing on this
    # clock, so T* = sqrt(2 C M) clamps to min_interval: every 6 steps.
    assert target.saves == [(6, "first_measurement"), (12, "interval"), (18, "interval")]
    assert not (tmp_path / "ckpt" / "resume_history.json").exists()  # the history travels in the checkpoints


def test_schedule_arguments_are_validated_together() -> None:
    with pytest.raises(ConfigurationError) as err:
        ExactResume(
            mtbf="soon",
            schedule=ScheduleOptions(min_interval="-1s", every_n_train_steps_max=0),
            memory_tier=MemoryTierOptions(dir="s3://bucket/shm"),
        )
    text = str(err.value)
    assert "mtbf='soon'" in text and "schedule.every_n_train_steps_max=0" in text
    assert "memory_tier.dir='s3://bucket/shm' must be a local" in text  # the memory tier's, in the same error


def test_fallback_snapshots_are_found_by_last(tmp_path: Path) -> None:
    clock = StepClock()
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=0)
    _fit(
        tmp_path,
        [
            clock,
            with_clocks(ExactResume(mtbf=None, schedule=ScheduleOptions(every_n_train_steps_max=5)), clock=clock),
            ckpt,
        ],
        steps=12,
    )
    snaps = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("last-snapshot"))
    assert snaps == ["last-snapshot-step=000000010.ckpt"]  # the older one removed after the newer was written
    assert ckpt._find_last_checkpoints(pl.Trainer(logger=False)) == {str(tmp_path / "ckpt" / snaps[0])}


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
    clock, recorder = StepClock(save_cost=0.5), Recorder()
    target = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=0)
    exact = with_clocks(
        ExactResume(mtbf="1h", schedule=ScheduleOptions(min_interval="30s", max_interval="30s")), clock=clock
    )
    _fit(tmp_path, [clock, exact, target], steps=9, logger=recorder, log_every_n_steps=1000)
    rows = [(s, m) for s, m in recorder.rows if "ckpt/blocked_s" in m]
    assert [s for s, _ in rows] == [3, 6, 9]
    metrics = rows[-1][1]
    assert metrics["ckpt/interval_s"] == 30.0 and metrics["ckpt/mtbf_s"] == 3600.0
    assert metrics["ckpt/bytes"] == os.path.getsize(tmp_path / "ckpt" / "last-snapshot-step=000000009.ckpt")
    assert metrics["ckpt/blocked_s"] == 0.5 and 0 < metrics["ckpt/expected_waste"] < 1
    assert metrics["ckpt/cost_s"] > 0 and metrics["ckpt/write_MBps"] > 0


def test_observed_mtbf_learns_from_restarts_dated_by_the_wall_clock(tmp_path: Path) -> None:
    """Each resume extends the failure history the checkpoints carry, dated by ExactResume's wall clock (the
    checkpoints too); mtbf="observed" turns failures into a shorter M."""
    from lightning_resume.schedule.history import history_from_json

    ckpt, wall = tmp_path / "ckpt", StepClock()  # one wall clock for every "process", 10 s per batch
    wall.now = 1e6
    for run, steps in enumerate((6, 12, 18)):
        clock = StepClock()
        exact = with_clocks(
            ExactResume(mtbf="observed", schedule=ScheduleOptions(mtbf_prior="1000h", every_n_train_steps_max=3)),
            clock=clock,
            wall_clock=wall,
        )
        if run:  # the previous "process" died after its last snapshot: 100 s of downtime
            wall.now += 100.0
        callbacks = [clock, wall, exact, ModelCheckpoint(dirpath=str(ckpt), save_top_k=0)]
        _fit(tmp_path, callbacks, steps=steps, ckpt_path="last" if run else None)
    assert sorted(p.name for p in ckpt.iterdir()) == ["last-snapshot-step=000000018.ckpt"]  # no file of ours
    state = torch.load(ckpt / "last-snapshot-step=000000018.ckpt", weights_only=True)["callbacks"]["ExactResume"]
    history = history_from_json(state["schedule"]["history"])
    assert len(history.events) == 2 and len(history.failures) == 2
    assert history.run_start == 1e6 and [e.restart_time for e in history.events] == [1e6 + 160.0, 1e6 + 320.0]
    assert [e.lost_s for e in history.events] == [100.0, 100.0]  # the snapshot resumed from was taken just before
    assert exact.scheduler.state.mtbf_s < 1000 * 3600 / 2  # two failures in seconds of uptime: M far below the prior


def test_default_retention_checkpoint_keeps_its_topk_untouched(tmp_path: Path) -> None:
    """RetentionCheckpoint with default arguments is ModelCheckpoint: snapshots go beside its files."""
    from lightning_resume import RetentionCheckpoint

    clock = StepClock()
    topk = RetentionCheckpoint(dirpath=str(tmp_path / "ckpt"), monitor="val_loss", save_top_k=2)
    exact = with_clocks(ExactResume(mtbf=None, schedule=ScheduleOptions(every_n_train_steps_max=3)), clock=clock)
    _fit(tmp_path, [clock, exact, topk], n=80, val_check_interval=10, limit_val_batches=2)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.suffix == ".ckpt")
    assert len(topk.best_k_models) == 2 and all("last-snapshot" not in p for p in topk.best_k_models)
    # the snapshots went beside its files (the last, of step 18, until the top-k file of step 20 superseded it
    # at the clean end: exact.snapshots.remove_superseded); retention's own names never appeared
    assert names == ["epoch=0-step=10.ckpt", "epoch=0-step=20.ckpt"]
    assert not any(n.startswith("step=") for n in names)


def test_signal_handlers_are_given_back_when_fit_fails(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)

    class Boom(Model):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    with pytest.raises(RuntimeError, match="boom"):
        _fit(tmp_path, [ExactResume(), ModelCheckpoint(dirpath=str(tmp_path / "ckpt"))], steps=5, model=Boom, n=40)
    assert signal.getsignal(signal.SIGTERM) is before
