"""Applying a plan to plain modules: bitwise gradients, identical dropout masks, unchanged keys."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import set_checkpoint_early_stop

from lightning_resume.activation.apply import apply_plan, remove_activation_checkpointing
from lightning_resume.activation.measure import block_records, measure_saved_bytes
from lightning_resume.activation.policy import BlockSelection, CheckpointPlan, plan_checkpointing
from lightning_resume.errors import ConfigurationError
from tests.helpers.models import Block, block_class_path, checkpointed_modules

X = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(3))


def make(n: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(n)])


def plan_for(model: nn.Module, mode: str, **kwargs) -> CheckpointPlan:
    names = [r.name for r in block_records(model) if r.name]
    saved = measure_saved_bytes(model, lambda: model(X), names)
    return plan_checkpointing(
        block_records(model, saved), BlockSelection((block_class_path(),), None, mode, **kwargs), saved.total
    )


def grads(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(123)  # dropout masks come from here
    out = model(X)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


MODES = [("all", {}), ("every", {"every": 2}), ("sqrt", {}), ("budget", {"budget_bytes": 90_000})]


@pytest.mark.parametrize("mode,kwargs", MODES)
def test_gradients_are_bitwise_equal_with_dropout(mode, kwargs):
    plain, checkpointed = make(), make()
    plan = plan_for(checkpointed, mode, **kwargs)
    apply_plan(checkpointed, plan)
    assert checkpointed_modules(checkpointed)  # something really is recomputed
    out0, g0 = grads(plain)
    out1, g1 = grads(checkpointed)
    assert torch.equal(out0, out1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))


def test_the_plan_really_saves_memory_as_estimated():
    model = make(9)
    for mode in ("all", "sqrt", "every"):
        plan = plan_for(model, mode, **({"every": 2} if mode == "every" else {}))
        apply_plan(model, plan)
        kept = measure_saved_bytes(model, lambda: model(X), keep_inputs_of=[u[0] for u in plan.units]).total
        assert kept == plan.bytes_after < plan.bytes_before
        remove_activation_checkpointing(model)


def test_dropout_masks_are_identical_in_the_recomputation():
    model = make(2)
    apply_plan(model, plan_for(model, "all"))
    masks: list[torch.Tensor] = []
    for block in model:
        block.drop.register_forward_hook(lambda _m, _i, out: masks.append(out == 0))
    # Early stop would end the recomputation inside the dropout (its mask is the last saved
    # tensor), before its forward hook; turned off here so the hook sees the recomputed mask.
    with set_checkpoint_early_stop(False):
        grads(model)
    assert len(masks) == 4  # 2 forward + 2 recomputed in backward
    forward, recomputed = masks[:2], masks[2:][::-1]  # backward recomputes the last block first
    assert all(m.any() for m in forward)
    assert all(torch.equal(a, b) for a, b in zip(forward, recomputed))


def test_state_dict_keys_and_names_do_not_change_and_load_both_ways():
    plain, checkpointed = make(), make()
    apply_plan(checkpointed, plan_for(checkpointed, "sqrt"))
    assert list(plain.state_dict()) == list(checkpointed.state_dict())
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in checkpointed.named_parameters()]
    with torch.no_grad():
        for p in checkpointed.parameters():
            p.add_(1.0)
    plain.load_state_dict(checkpointed.state_dict())  # strict: on -> off
    fresh = make()
    apply_plan(fresh, plan_for(fresh, "all"))
    fresh.load_state_dict(plain.state_dict())  # strict: off -> on
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), checkpointed.state_dict().values()))


def test_deepcopy_uses_the_copys_own_parameters():
    model = make(2)
    apply_plan(model, plan_for(model, "all"))
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.zero_()
    assert not torch.equal(model.eval()(X), clone.eval()(X))
    assert checkpointed_modules(clone) == ["0", "1"]


def test_remove_restores_the_plain_forward_and_apply_twice_is_refused():
    model = make(3)
    plan = plan_for(model, "sqrt")
    apply_plan(model, plan)
    with pytest.raises(ConfigurationError, match="already"):
        apply_plan(model, plan)
    assert remove_activation_checkpointing(model) == 2  # the Sequential (segment 0-1) and block "2"
    assert checkpointed_modules(model) == []
    assert "forward" not in model.__dict__


def test_no_grad_runs_the_plain_forward():
    model = make(2)
    apply_plan(model, plan_for(model, "all"))
    with torch.no_grad():
        saved = measure_saved_bytes(model, lambda: model(X))
    assert saved.total > 0  # measure turns grad on: the checkpointed path ran and kept only inputs
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(X), make(2).eval()(X))


def test_plan_naming_a_missing_module_is_refused():
    with pytest.raises(ConfigurationError, match="does not have"):
        apply_plan(make(2), CheckpointPlan("all", (("7",),), 1, 0.0))
