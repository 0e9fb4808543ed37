"""ExactResume, RetentionCheckpoint and SafetensorsCheckpointIO configured from LightningCLI YAML:
the shipped config parses, trains, snapshots on its schedule and resumes from "last" (in this process;
``lightning-resume inspect`` on a subprocess run's checkpoint: tests/integration/test_exact_inspect.py)."""

from __future__ import annotations

from pathlib import Path

import lightning
import yaml
from lightning.pytorch.cli import LightningCLI

from lightning_resume import ExactResume, RetentionCheckpoint, SafetensorsCheckpointIO
from lightning_resume.format.read import is_safetensors
from tests.helpers.models import TINY_TRAINER, TinyData, TinyModel
from tests.helpers.paths import REPO_ROOT as REPO


def _config(tmp_path: Path, max_steps: int) -> Path:
    config = yaml.safe_load((REPO / "configs" / "exact_resume.yaml").read_text())
    exact, retention = (c["init_args"] for c in config["trainer"]["callbacks"])
    assert exact["mtbf"] == "24h" and retention["retention"]["keep_last"] == 3
    exact["schedule"].update(every_n_train_steps_max=3)
    retention.update(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=4)
    retention["retention"].update(anchor_every_n_steps=8)
    config["trainer"].update(TINY_TRAINER, max_steps=max_steps, val_check_interval=2)
    path = tmp_path / f"config-{max_steps}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_shipped_yaml_trains_snapshots_and_resumes(tmp_path: Path) -> None:
    lightning.seed_everything(0, verbose=False)
    run = LightningCLI(
        TinyModel, TinyData, args=["fit", "--config", str(_config(tmp_path, 10))], save_config_callback=None
    )
    exact = next(c for c in run.trainer.callbacks if isinstance(c, ExactResume))
    assert exact.scheduler is not None and exact.scheduler.config.mtbf_s == 24 * 3600.0
    assert isinstance(run.trainer.strategy.checkpoint_io, SafetensorsCheckpointIO)
    assert any(isinstance(c, RetentionCheckpoint) for c in run.trainer.callbacks)
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.suffix == ".ckpt")
    assert "step=000000009.ckpt" in files  # a scheduled snapshot (step cap 3) through RetentionCheckpoint
    assert all(is_safetensors(str(tmp_path / "ckpt" / name)) for name in files)  # no pickle anywhere
    resumed = LightningCLI(
        TinyModel,
        TinyData,
        args=["fit", "--config", str(_config(tmp_path, 14)), "--ckpt_path", "last"],
        save_config_callback=None,
    )
    exact = next(c for c in resumed.trainer.callbacks if isinstance(c, ExactResume))
    assert exact.resume_report.exact and exact.resume_report.fingerprint_ok
    assert resumed.trainer.global_step == 14
