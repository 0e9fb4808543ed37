"""LightningCLI YAML selects the activation-checkpointing strategy by class path (model defined here)."""

from __future__ import annotations

import torch
import yaml
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_resume.activation.strategies import ActivationCheckpointingStrategy
from tests.helpers.models import TINY_TRAINER, checkpointed_modules


class TinyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class TinyModel(LightningModule):
    def __init__(self, depth: int = 5) -> None:
        super().__init__()
        self.trunk = nn.Sequential(*[TinyBlock() for _ in range(depth)])
        self.example_input_array = torch.zeros(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trunk(x)

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=4)


# YAML names the block class by its import path: wherever pytest imported this module from.
TINY_BLOCK = f"{TinyBlock.__module__}.{TinyBlock.__qualname__}"

TRAINER = {"max_steps": 2, **TINY_TRAINER, "enable_checkpointing": False}


def cli_with(tmp_path, monkeypatch, **init_args) -> LightningCLI:
    """LightningCLI from a YAML file whose trainer's strategy is ActivationCheckpointingStrategy(**init_args)."""
    strategy = {"class_path": "lightning_resume.ActivationCheckpointingStrategy", "init_args": init_args}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"trainer": {**TRAINER, "strategy": strategy}}))
    monkeypatch.setattr("sys.argv", ["prog"])
    return LightningCLI(TinyModel, run=False, args=["--config", str(config)], save_config_callback=None)


def test_yaml_class_path_and_sqrt_segments(tmp_path, monkeypatch):
    cli = cli_with(tmp_path, monkeypatch, blocks=TINY_BLOCK, select="sqrt")
    assert isinstance(cli.trainer.strategy, ActivationCheckpointingStrategy)
    cli.trainer.fit(cli.model)
    plan = cli.trainer.strategy.activation_plan
    assert [len(u) for u in plan.units] == [2, 2, 1]  # ceil(sqrt(5)) = 3 segments
    assert checkpointed_modules(cli.model) == ["trunk", "trunk.4"]


def test_yaml_budget_with_glob_and_size_string(tmp_path, monkeypatch):
    cli = cli_with(tmp_path, monkeypatch, pattern="trunk.*", select="budget", budget="0.9KiB")
    cli.trainer.fit(cli.model)
    plan = cli.trainer.strategy.activation_plan
    assert cli.trainer.strategy.activation_selection.budget_bytes == 921
    assert plan.bytes_after <= 921 < plan.bytes_before and len(plan.units) >= 1


def test_yaml_selective_recompute_with_an_op_list(tmp_path, monkeypatch):
    save_ops = ["aten.addmm", "aten.mm.default"]
    cli = cli_with(tmp_path, monkeypatch, blocks=TINY_BLOCK, recompute="selective", save_ops=save_ops)
    selection = cli.trainer.strategy.activation_selection
    assert selection.recompute == "selective" and selection.save_ops == ("aten.addmm", "aten.mm.default")
    cli.trainer.fit(cli.model)
    plan = cli.trainer.strategy.activation_plan
    assert len(plan.selective) == 5 and plan.save_ops == ("aten.addmm", "aten.mm.default")
