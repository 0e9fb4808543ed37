"""Selective recomputation on plain modules: bitwise gradients (dropout, SDPA), what is kept, what is rerun."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_resume.activation.apply import apply_plan, keeps_output, resolve_save_ops
from lightning_resume.activation.measure import (
    block_records,
    measure_kept_bytes,
    measure_recompute,
    measure_saved_bytes,
)
from lightning_resume.activation.policy import DEFAULT_SAVE_OPS, BlockSelection, CheckpointPlan, plan_checkpointing
from lightning_resume.errors import ConfigurationError
from tests.helpers.models import Block, checkpointed_modules

X = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(3))


class AttentionBlock(nn.Module):
    """Pre-norm self-attention through F.scaled_dot_product_attention, then dropout on the residual branch."""

    def __init__(self, width: int = 16, heads: int = 2, attn_dropout: float = 0.0) -> None:
        super().__init__()
        self.heads, self.attn_dropout = heads, attn_dropout
        self.norm = nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        p = self.attn_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))


def make(attn_dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        Block(), AttentionBlock(attn_dropout=attn_dropout), Block(), AttentionBlock(attn_dropout=attn_dropout)
    )


NAMES = ("0", "1", "2", "3")


def plan(kind: str, save_ops: tuple[str, ...] = DEFAULT_SAVE_OPS) -> CheckpointPlan:
    units = tuple((n,) for n in NAMES)
    if kind == "full":
        return CheckpointPlan("all", units, 4, 0.0)
    return CheckpointPlan("all", (), 4, 0.0, selective=units, save_ops=save_ops)


def build(kind: str, attn_dropout: float = 0.0) -> nn.Sequential:
    model = make(attn_dropout)
    if kind != "none":
        apply_plan(model, plan(kind))
    return model


def grads(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(123)  # dropout masks come from here
    out = model(X)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("attn_dropout", [0.0, 0.3])
def test_selective_gradients_are_bitwise_equal_to_full_and_to_none(attn_dropout):
    results = {kind: grads(build(kind, attn_dropout)) for kind in ("none", "full", "selective")}
    out0, g0 = results["none"]
    assert out0.abs().sum() > 0 and len(g0) == 24
    for kind in ("full", "selective"):
        out, g = results[kind]
        assert torch.equal(out, out0), kind
        assert all(torch.equal(a, b) for a, b in zip(g, g0, strict=True)), kind


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        self.calls[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def backward_calls(model: nn.Module, attn_dropout: float = 0.0) -> Counter[str]:
    torch.manual_seed(123)
    out = model(X)
    counter = _OpCounter()
    with counter:
        out.sum().backward()
    return counter.calls


def test_selective_rerun_skips_matmuls_and_attention_but_reruns_norms_and_dropout():
    full, selective = backward_calls(build("full")), backward_calls(build("selective"))
    # Linear's forward is addmm (its backward uses mm): addmm in backward means a rerun forward.
    assert full["addmm"] == 8 and selective["addmm"] == 0
    assert full["_scaled_dot_product_flash_attention_for_cpu"] == 2
    assert selective["_scaled_dot_product_flash_attention_for_cpu"] == 0
    for cheap in ("native_layer_norm", "gelu", "bernoulli_"):  # rerun in both: nothing of theirs kept
        assert full[cheap] == selective[cheap] > 0, cheap


def test_fused_attention_with_dropout_is_rerun_so_later_masks_stay_the_same():
    save = resolve_save_ops(DEFAULT_SAVE_OPS)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.zeros(1, 1, 2, 2)
    assert keeps_output(save, op, (q, q, q), {}) and keeps_output(save, op, (q, q, q, 0.0), {})
    assert not keeps_output(save, op, (q, q, q, 0.3), {})  # random: kept, it would not redraw in the rerun
    assert not keeps_output(save, op, (q, q, q), {"dropout_p": 0.1})


def test_kept_bytes_sit_between_full_and_none_and_match_the_plan_estimate():
    kept = {kind: measure_kept_bytes(lambda m=build(kind): m(X)) for kind in ("none", "full", "selective")}
    assert kept["full"] < kept["selective"] < kept["none"]
    model = make()
    saved = measure_saved_bytes(model, lambda: model(X), NAMES)
    save = resolve_save_ops(DEFAULT_SAVE_OPS)
    costs = measure_recompute(model, lambda: model(X), NAMES, lambda op, a, k: keeps_output(save, op, a, k), 1)
    selection = BlockSelection(pattern="?", recompute="selective")
    estimated = plan_checkpointing(block_records(model, saved, costs), selection, saved.total)
    batch = X.numel() * X.element_size()  # the census leaves out what existed before forward
    assert estimated.bytes_before - batch == kept["none"]
    assert estimated.bytes_after - batch == kept["selective"]
    assert all(costs.selective_seconds[n] < costs.forward_seconds[n] for n in NAMES)


def test_deepcopy_keeps_selective_recomputation():
    model = build("selective")
    clone = copy.deepcopy(model)
    assert checkpointed_modules(clone) == list(NAMES)
    _, g0 = grads(make())
    _, g1 = grads(clone)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))
    assert backward_calls(clone)["addmm"] == 0


def test_save_ops_names_are_checked():
    assert torch.ops.aten.mm.default in resolve_save_ops(("aten.mm",)).ops
    assert resolve_save_ops(("aten.mm.default",)).ops == frozenset({torch.ops.aten.mm.default})
    with pytest.raises(ConfigurationError) as info:
        resolve_save_ops(("aten.no_such_op", "aten.bernoulli", "aten.mm.nope"))
    text = str(info.value)
    assert "'aten.no_such_op' is not an op" in text and "'aten.bernoulli' is a random op" in text
    assert "'aten.mm.nope' is not an op" in text


def test_a_narrower_op_list_keeps_less_and_stays_bitwise():
    narrow = make()
    apply_plan(narrow, plan("selective", ("aten.addmm",)))
    default = build("selective")
    assert measure_kept_bytes(lambda: narrow(X)) < measure_kept_bytes(lambda: default(X))
    assert backward_calls(narrow)["_scaled_dot_product_flash_attention_for_cpu"] == 2  # attention now rerun
    _, g0 = grads(make())
    narrow.zero_grad(set_to_none=True)
    _, g1 = grads(narrow)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))
