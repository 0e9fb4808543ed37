"""Train a 24-block model under an activation-memory budget it would exceed without checkpointing.

The budget is a third of what plain training keeps for backward. The strategy measures every
block's saved activations on ``example_input_array``, recomputes the fewest blocks that fit, logs
the plan, and trains; the script then measures what the checkpointed model really keeps.

    python examples/activation_budget.py      # a few seconds on one CPU core
"""

from __future__ import annotations

import torch
from lightning import LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_resume import ActivationCheckpointingStrategy, measure_saved_bytes

WIDTH, DEPTH, BATCH, SEQ = 64, 24, 16, 32


class ResidualMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), nn.Dropout(0.1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.net(x)


class DeepRegressor(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ResidualMLP() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, 1)
        self.example_input_array = torch.zeros(BATCH, SEQ, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).squeeze(-1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        x = torch.randn(8 * BATCH, SEQ, WIDTH)
        return DataLoader(TensorDataset(x, x.mean(-1)), batch_size=BATCH, shuffle=True)


def kept_bytes(model: DeepRegressor, heads: list[str]) -> int:
    model.train()
    return measure_saved_bytes(model, lambda: model(model.example_input_array), keep_inputs_of=heads).total


def main() -> None:
    torch.set_num_threads(1)
    seed_everything(0)
    model = DeepRegressor()
    plain = kept_bytes(model, [])
    budget = plain // 3
    print(f"plain training keeps {plain / 2**20:.2f} MiB of activations; budget {budget / 2**20:.2f} MiB")
    strategy = ActivationCheckpointingStrategy(blocks=ResidualMLP, select="budget", budget=budget)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=16,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(model)
    plan = strategy.activation_plan
    kept = kept_bytes(model, [unit[0] for unit in plan.units])
    print(
        f"recomputing {len(plan.units)} of {DEPTH} blocks: kept {kept / 2**20:.2f} MiB"
        f" (<= budget: {kept <= budget}), final loss {trainer.callback_metrics['loss']:.4f}"
    )


if __name__ == "__main__":
    main()
