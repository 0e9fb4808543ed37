"""ExactResume, RetentionCheckpoint and SafetensorsCheckpointIO configured from LightningCLI YAML:
the shipped config parses, trains, snapshots on its schedule and resumes from "last"."""

from __future__ import annotations

from pathlib import Path

import lightning
import yaml
from lightning.pytorch.cli import LightningCLI

from lightning_resume import ExactResume, RetentionCheckpoint, SafetensorsCheckpointIO
from lightning_resume.io.files import is_safetensors
from tests.retention_helpers import TinyData, TinyModel

REPO = Path(__file__).resolve().parents[1]


def _config(tmp_path: Path, max_steps: int) -> Path:
    config = yaml.safe_load((REPO / "configs" / "exact_resume.yaml").read_text())
    exact, retention = (c["init_args"] for c in config["trainer"]["callbacks"])
    assert exact["mtbf"] == "24h" and retention["keep_last"] == 3
    exact.update(every_n_train_steps_max=3)
    retention.update(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=4, anchor_every_n_steps=8)
    config["trainer"].update(
        max_steps=max_steps, val_check_interval=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", num_sanity_val_steps=0, limit_val_batches=2,
    )
    path = tmp_path / f"config-{max_steps}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_shipped_yaml_trains_snapshots_and_resumes(tmp_path: Path) -> None:
    lightning.seed_everything(0, verbose=False)
    run = LightningCLI(TinyModel, TinyData, args=["fit", "--config", str(_config(tmp_path, 10))], save_config_callback=None)
    exact = next(c for c in run.trainer.callbacks if isinstance(c, ExactResume))
    assert exact.scheduler is not None and exact.scheduler.config.mtbf_s == 24 * 3600.0
    assert isinstance(run.trainer.strategy.checkpoint_io, SafetensorsCheckpointIO)
    assert any(isinstance(c, RetentionCheckpoint) for c in run.trainer.callbacks)
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.suffix == ".ckpt")
    assert "step=000000009.ckpt" in files  # a scheduled snapshot (step cap 3) through RetentionCheckpoint
    assert all(is_safetensors(str(tmp_path / "ckpt" / name)) for name in files)  # no pickle anywhere
    resumed = LightningCLI(
        TinyModel, TinyData, args=["fit", "--config", str(_config(tmp_path, 14)), "--ckpt_path", "last"],
        save_config_callback=None,
    )
    exact = next(c for c in resumed.trainer.callbacks if isinstance(c, ExactResume))
    assert exact.resume_report["exact"] and exact.resume_report["fingerprint_ok"]
    assert resumed.trainer.global_step == 14


def test_inspect_shows_what_exact_resume_saved(tmp_path: Path, capsys) -> None:
    import json

    from lightning_resume import cli
    from tests.exact import harness as h

    cfg = {"out": str(tmp_path / "A"), "ckpt_dir": str(tmp_path / "ckpt"), "n": 40, "batch_size": 4, "max_epochs": 1,
           "num_workers": 2, "augment": True, "safetensors": True,
           "ckpt": {"every_n_train_steps": 5, "save_top_k": -1, "filename": "{step}"}}
    h.run(cfg, tmp_path)
    assert cli.main(["inspect", str(tmp_path / "ckpt" / "step=5.ckpt"), "--json"]) == 0
    exact = json.loads(capsys.readouterr().out)["exact_resume"]
    (rank,) = exact["ranks"]
    assert exact["world_size"] == 1 and rank["rng_streams"][:3] == ["python", "numpy", "torch"]
    assert rank["loader_positions"] == ["5 batches yielded, 2 worker states"]
    assert set(rank["fingerprint"]) == {"weights", "optimizer", "rng", "data", "step"} and rank["fingerprint"]["step"] == "5"
    assert cli.main(["inspect", str(tmp_path / "ckpt" / "step=5.ckpt")]) == 0
    assert "rank 0: RNG python, numpy, torch" in capsys.readouterr().out
