"""FSDP: the plan is handed to FSDP's native activation checkpointing (no GPU here, so no real wrap)."""

from __future__ import annotations

import pytest
from lightning.pytorch.strategies import FSDPStrategy

from lightning_resume.activation.strategies import ActivationCheckpointingFSDPStrategy
from lightning_resume.errors import ConfigurationError
from tests.helpers.models import Block, Stack


def test_fsdp_check_fn_selects_exactly_the_planned_blocks(monkeypatch):
    monkeypatch.setattr(FSDPStrategy, "_setup_model", lambda self, model: model)  # FSDP needs a GPU
    strategy = ActivationCheckpointingFSDPStrategy(blocks=Block, select="every", every=2)
    model = Stack(n_blocks=5)
    strategy._setup_model(model)
    check_fn = strategy._activation_checkpointing_kwargs["check_fn"]
    chosen = [name for name, module in model.named_modules() if check_fn(module)]
    assert chosen == ["layers.0", "layers.2", "layers.4"]
    assert "forward" not in model.layers[0].__dict__  # FSDP's own wrapper does the recomputing


def test_fsdp_refuses_sqrt_segments_and_a_second_policy():
    with pytest.raises(ConfigurationError, match="sqrt"):
        ActivationCheckpointingFSDPStrategy(blocks=Block, select="sqrt")
    with pytest.raises(ConfigurationError, match="activation_checkpointing_policy"):
        ActivationCheckpointingFSDPStrategy(blocks=Block, activation_checkpointing_policy={Block})


def test_fsdp_refuses_selective_recomputation():
    with pytest.raises(ConfigurationError, match="recompute='selective' cannot be delegated to FSDP"):
        ActivationCheckpointingFSDPStrategy(blocks=Block, recompute="selective")
