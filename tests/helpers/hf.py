"""Tiny Hugging Face ``transformers`` models (Llama, GPT-2, BERT) built from configs with random init, in a
LightningModule, for the activation-checkpointing tests and ``jobs/hf_job.py``; and the job's launcher.

Nothing is downloaded: ``HF_HUB_OFFLINE=1`` is set before ``transformers`` is imported. Each config is
the library's default except its size (hidden 32, 2 layers, vocabulary 100, sequences of 16), so the
default ``use_cache=True`` and dropout are on; Llama's default attention dropout is 0, so it gets 0.1 (a
run with no random op could not show that the recompute draws the same masks). Tests that compare bit for
bit depend on these definitions and seeds.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from lightning.pytorch import LightningModule
from torch.utils.data import Dataset
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

from lightning_resume import ActivationCheckpointingStrategy, measure_saved_bytes
from tests.helpers import processes
from tests.helpers.paths import job_script

VOCAB, HIDDEN, LAYERS, HEADS, SEQ = 100, 32, 2, 4, 16
FAMILIES = ("llama", "gpt2", "bert")
BLOCKS = {
    "llama": "transformers.models.llama.modeling_llama.LlamaDecoderLayer",
    "gpt2": "transformers.models.gpt2.modeling_gpt2.GPT2Block",
    "bert": "transformers.models.bert.modeling_bert.BertLayer",
}
"""The class path of each family's repeated block: what a user passes as ``blocks``."""


def build(family: str) -> PreTrainedModel:
    """A tiny, randomly initialised model of ``family`` (its config's defaults apart from the size)."""
    if family == "llama":
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=HEADS // 2,
            attention_dropout=0.1,
        )
        return LlamaForCausalLM(config)
    if family == "gpt2":
        return GPT2LMHeadModel(
            GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=SEQ)
        )
    if family == "bert":
        config = BertConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            intermediate_size=2 * HIDDEN,
            max_position_embeddings=SEQ,
        )
        return BertForMaskedLM(config)
    raise ValueError(f"unknown family {family!r}; use one of {FAMILIES}")


class Tokens(Dataset):
    """Deterministic token sequences; every third one padded at its end (attention mask 0, label -100)."""

    def __init__(self, n: int = 24) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.mask = torch.ones(n, SEQ, dtype=torch.long)
        self.mask[::3, SEQ - 5 :] = 0

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        labels = self.ids[i].masked_fill(self.mask[i] == 0, -100)
        return {"id": i, "input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": labels}


class HFModule(LightningModule):
    """A ``transformers`` model trained on its own loss (``labels`` in the batch); keeps every step's loss."""

    def __init__(self, family: str, lr: float = 1e-2) -> None:
        super().__init__()
        self.net = build(family)
        self.lr = lr
        self.step_losses: list[torch.Tensor] = []
        batch = Tokens(4)
        self.example_input_array = {"input_ids": batch.ids, "attention_mask": batch.mask}  # select="budget" measures it

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=input_ids, attention_mask=attention_mask).logits

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        self.step_losses.append(out.loss.detach().clone())
        return out.loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def start_job(cfg: dict[str, Any]) -> subprocess.Popen:
    """Start ``jobs/hf_job.py`` on ``cfg`` (written to ``<out>/config.json``), its output to ``<out>/stdout.txt``."""
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    args = [job_script("hf_job.py"), out / "config.json"]
    return processes.start(args, env={"HF_HUB_OFFLINE": "1"}, cwd=out, log=out / "stdout.txt")


def job_output(cfg: dict[str, Any]) -> str:
    return (Path(cfg["out"]) / "stdout.txt").read_text()[-6000:]


def finish_job(proc: subprocess.Popen, cfg: dict[str, Any], timeout: float = 240) -> None:
    """Wait for a job to end; raise with its output if it fails or outlives ``timeout``."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        processes.kill(proc)
        raise AssertionError(f"job timed out:\n{job_output(cfg)}") from None
    assert rc == 0, f"job failed with {rc}:\n{job_output(cfg)}"


def kill_when_paused(proc: subprocess.Popen, cfg: dict[str, Any], timeout: float = 240) -> None:
    """SIGKILL a job (``pause_before`` set) from outside once it blocks where its config says."""
    marker = Path(cfg["out"]) / "paused"
    processes.kill_when(proc, marker.exists, timeout, log=lambda: job_output(cfg))


MODES = ("full", "selective", "budget")


def strategy_for(module: HFModule, family: str, mode: str) -> ActivationCheckpointingStrategy:
    """The strategy a user would write for ``mode`` on ``family``'s blocks.

    ``"budget"``: a budget one byte under what the model keeps, so that the planner recomputes some blocks.
    """
    if mode == "budget":
        blocks = [name for name, m in module.named_modules() if type(m).__name__ == BLOCKS[family].rpartition(".")[2]]
        with torch.random.fork_rng():  # the measured forward's dropout draws stay out of the run
            kept = measure_saved_bytes(module, lambda: module(**module.example_input_array), blocks).total
        return ActivationCheckpointingStrategy(blocks=BLOCKS[family], select="budget", budget=kept - 1, log_plan=False)
    return ActivationCheckpointingStrategy(blocks=BLOCKS[family], recompute=mode, log_plan=False)
