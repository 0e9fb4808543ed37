"""Real Lightning fits with the activation-checkpointing strategy on one CPU device."""

from __future__ import annotations

import logging

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from lightning_resume.activation.strategies import ActivationCheckpointingStrategy
from lightning_resume.errors import ConfigurationError
from tests.helpers.models import Block, Stack, block_class_path, checkpointed_modules


def fit(strategy=None, steps: int = 6, ckpt_path=None, model=None, **trainer_kwargs) -> Stack:
    seed_everything(11)
    model = model or Stack(n_blocks=4)
    seed_everything(12)  # training draws the same numbers whoever built the model
    kwargs = {"strategy": strategy} if strategy is not None else {}
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **kwargs,
        **trainer_kwargs,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    model.trainer_ = trainer
    return model


def same_weights(a: Stack, b: Stack) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("select", ["all", "sqrt"])
def test_fit_losses_and_weights_are_bitwise_equal_to_plain_training(select):
    plain = fit()
    checkpointed = fit(ActivationCheckpointingStrategy(blocks=Block, select=select))
    assert checkpointed_modules(checkpointed)  # the hook really applied the plan
    assert len(plain.step_losses) == 6
    assert all(torch.equal(a, b) for a, b in zip(plain.step_losses, checkpointed.step_losses))
    assert same_weights(plain, checkpointed)


def test_checkpoint_from_either_side_resumes_on_the_other(tmp_path):
    resumed = []
    for save_with, resume_with in [
        (ActivationCheckpointingStrategy(blocks=Block), None),
        (None, ActivationCheckpointingStrategy(pattern="layers.*")),
    ]:
        first = fit(save_with, steps=4)
        path = tmp_path / f"saved_with_{save_with is not None}.ckpt"
        first.trainer_.save_checkpoint(path)
        resumed.append(fit(resume_with, steps=8, ckpt_path=str(path)))  # Lightning loads strictly
    on_to_off, off_to_on = resumed
    assert checkpointed_modules(off_to_on) and not checkpointed_modules(on_to_off)
    assert len(on_to_off.step_losses) == 4
    assert all(torch.equal(a, b) for a, b in zip(on_to_off.step_losses, off_to_on.step_losses))
    assert same_weights(on_to_off, off_to_on)


def test_keys_identical_on_and_off():
    plain, checkpointed = (
        Stack(),
        fit(ActivationCheckpointingStrategy(blocks=block_class_path(), select="every", every=2), steps=1),
    )
    assert checkpointed_modules(checkpointed) == ["layers.0", "layers.2"]
    assert list(plain.state_dict()) == list(checkpointed.trainer_.lightning_module.state_dict())


def test_budget_uses_example_input_array_and_logs_the_plan(caplog):
    model = Stack(n_blocks=6)
    model.example_input_array = torch.randn(8, 8, 16)
    with caplog.at_level(logging.INFO):
        fit(ActivationCheckpointingStrategy(blocks=Block, select="budget", budget="150KiB"), steps=2, model=model)
    plan = model.trainer_.strategy.activation_plan
    assert 0 < len(plan.units) < 6 and plan.bytes_after <= 150 * 1024 < plan.bytes_before
    assert "activation checkpointing (budget)" in caplog.text and "estimated" in caplog.text
    assert checkpointed_modules(model) == list(plan.blocks)


def test_budget_measurement_leaves_rng_and_losses_untouched():
    plain = fit()
    seed_everything(11)
    model = Stack(n_blocks=4)  # the same initial weights as fit() builds
    model.example_input_array = torch.randn(8, 8, 16)
    measured = fit(ActivationCheckpointingStrategy(blocks=Block, select="budget", budget="200KiB"), model=model)
    assert all(torch.equal(a, b) for a, b in zip(plain.step_losses, measured.step_losses))


def test_budget_without_example_input_is_a_clear_error():
    with pytest.raises(ConfigurationError, match="example_input_array"):
        fit(ActivationCheckpointingStrategy(blocks=Block, select="budget", budget=1000), steps=1)


def test_impossible_budget_and_unmatched_pattern_are_clear_errors():
    model = Stack()
    model.example_input_array = torch.randn(8, 8, 16)
    with pytest.raises(ConfigurationError, match="cannot be met"):
        fit(ActivationCheckpointingStrategy(blocks=Block, select="budget", budget=10), steps=1, model=model)
    with pytest.raises(ConfigurationError, match="no module matches pattern='model.layers.*'"):
        fit(ActivationCheckpointingStrategy(pattern="model.layers.*"), steps=1)


def test_bad_arguments_fail_at_construction():
    with pytest.raises(ConfigurationError, match="not an nn.Module class"):
        ActivationCheckpointingStrategy(blocks="no.such.Block")
    with pytest.raises(ConfigurationError, match="sqrt.*ModuleList|nn.Sequential"):
        fit(ActivationCheckpointingStrategy(blocks=Block, select="sqrt"), steps=1, model=Stack(sequential=False))


def test_validate_after_fit_replans_instead_of_wrapping_twice():
    model = fit(ActivationCheckpointingStrategy(blocks=Block), steps=2)
    model.val_dataloader = model.train_dataloader
    model.validation_step = lambda batch, batch_idx: None
    model.trainer_.validate(model, verbose=False)
    assert checkpointed_modules(model) == [f"layers.{i}" for i in range(4)]


def test_device_follows_the_trainer():
    strategy = ActivationCheckpointingStrategy(blocks=Block)
    Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)
    assert strategy.root_device == torch.device("cpu") and strategy.parallel_devices == [torch.device("cpu")]


def test_selective_fit_is_bitwise_equal_to_plain_training():
    plain = fit()
    selective = fit(ActivationCheckpointingStrategy(blocks=Block, recompute="selective"))
    plan = selective.trainer_.strategy.activation_plan
    assert plan.units == () and len(plan.selective) == 4
    assert checkpointed_modules(selective) == [f"layers.{i}" for i in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(plain.step_losses, selective.step_losses, strict=True))
    assert same_weights(plain, selective)


def test_budget_with_selective_logs_a_per_block_table(caplog):
    model = Stack(n_blocks=6)
    model.example_input_array = torch.randn(8, 8, 16)
    strategy = ActivationCheckpointingStrategy(blocks=Block, select="budget", budget="150KiB", recompute="selective")
    with caplog.at_level(logging.INFO):
        fit(strategy, steps=2, model=model)
    plan = strategy.activation_plan
    assert plan.bytes_after <= 150 * 1024 < plan.bytes_before
    assert len(plan.rows) == 6 and all(r.recompute_seconds is not None and r.kept_bytes is not None for r in plan.rows)
    assert "recompute ms" in caplog.text and "measured op times" in caplog.text
    assert checkpointed_modules(model) == list(plan.blocks)


def test_selective_options_fail_at_construction():
    with pytest.raises(ConfigurationError, match="save_ops is only used with recompute='selective'"):
        ActivationCheckpointingStrategy(blocks=Block, save_ops=["aten.mm"])
    with pytest.raises(ConfigurationError, match="'aten.bernoulli' is a random op"):
        ActivationCheckpointingStrategy(blocks=Block, recompute="selective", save_ops=["aten.mm", "aten.bernoulli"])
