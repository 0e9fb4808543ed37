"""Activation checkpointing on real Hugging Face ``transformers`` models (Llama, GPT-2, BERT; tiny, random init,
built from their default configs: ``use_cache=True``, dropout on), and the per-call-state rule behind it."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader

from lightning_resume.activation.apply import checkpoint_block
from lightning_resume.activation.call_state import CallStateSwitch
from lightning_resume.errors import ConfigurationError
from tests.helpers.hf import BLOCKS, FAMILIES, MODES, SEQ, HFModule, Tokens, build, strategy_for
from tests.helpers.models import QUIET, checkpointed_modules

STEPS = 3
USE_CACHE = {"llama": True, "gpt2": False, "bert": True}
"""The config both runs of a comparison use. HF's defaults (``use_cache=True``), except GPT-2: checkpointed
blocks run without their cache, and GPT-2's attention itself differs in the last bits with and without one
(cached keys and values are contiguous copies, uncached ones strided views of one projection), so a plan that
recomputes some of its blocks (``budget``) matches neither run; with ``use_cache=False`` every plan matches."""


def fit(family: str, mode: str | None, use_cache: bool) -> HFModule:
    seed_everything(3, verbose=False)
    module = HFModule(family)
    module.net.config.use_cache = use_cache
    strategy = strategy_for(module, family, mode) if mode else "auto"
    seed_everything(4, verbose=False)  # training draws the same numbers (shuffle, dropout) in every run
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=STEPS, enable_checkpointing=False, **QUIET
    )
    trainer.fit(module, DataLoader(Tokens(), batch_size=4, shuffle=True))
    return module


@functools.cache
def plain(family: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Losses and final weights of the run without checkpointing that a checkpointed run must equal bit for bit."""
    module = fit(family, None, USE_CACHE[family])
    return module.step_losses, module.state_dict()


def assert_same_run(family: str, checkpointed: HFModule) -> None:
    assert checkpointed_modules(checkpointed)  # the plan really recomputes blocks
    losses, weights = plain(family)
    assert len(checkpointed.step_losses) == STEPS
    assert all(torch.equal(a, b) for a, b in zip(losses, checkpointed.step_losses))
    state = checkpointed.state_dict()
    assert list(state) == list(weights) and all(torch.equal(state[k], weights[k]) for k in weights)


def notes(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "runs with" in r.getMessage()]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_checkpointed_training_is_bitwise_equal_to_training_without(family, mode, caplog):
    with caplog.at_level(logging.INFO):
        assert_same_run(family, fit(family, mode, USE_CACHE[family]))
    if family == "llama":  # its cache switched off: one line for the class, however many blocks and steps
        assert len(notes(caplog)) == 1 and "LlamaDecoderLayer" in notes(caplog)[0], notes(caplog)
        assert "cache=None, use_cache=False" in notes(caplog)[0]
    else:  # BERT's encoder layers get no cache; GPT-2 here runs with use_cache=False
        assert notes(caplog) == []


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_gpt2_with_its_default_cache_trains_as_with_use_cache_false(mode, caplog):
    """Every block recomputed: each runs without the cache GPT-2 passes positionally, as with use_cache=False."""
    with caplog.at_level(logging.INFO):
        assert_same_run("gpt2", fit("gpt2", mode, use_cache=True))
    assert len(notes(caplog)) == 1 and "GPT2Block" in notes(caplog)[0]


def _checkpoint_layers(net: nn.Module, family: str, switch: CallStateSwitch) -> int:
    layers = [m for m in net.modules() if type(m).__name__ == BLOCKS[family].rpartition(".")[2]]
    for layer in layers:
        checkpoint_block(layer, call_state=switch)
    return len(layers)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_cache_is_switched_off_only_where_the_call_is_recomputed(family):
    torch.manual_seed(0)
    net, lines = build(family), []
    assert _checkpoint_layers(net, family, CallStateSwitch(lines.append)) == 2
    ids = Tokens(4).ids
    out = net(input_ids=ids, labels=ids)
    out.loss.backward()  # once crashed here: the rerun appended to the cache a second time
    assert out.cache.get_seq_length() == 0  # switched off in training, as HF's gradient checkpointing does
    assert len(lines) == 1 and "cache=None" in lines[0]
    with torch.no_grad():  # nothing is recomputed: validation and generation keep their cache
        assert net(input_ids=ids, use_cache=True).cache.get_seq_length() == SEQ


class FakeCache:
    """The shape of HF's ``Cache``: ``update`` appends, ``get_seq_length`` knows the length."""

    def __init__(self) -> None:
        self.calls = 0

    def update(self, *args: object, **kwargs: object) -> None:
        self.calls += 1

    def get_seq_length(self) -> int:
        return self.calls


class RequiresCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: FakeCache) -> torch.Tensor:
        cache.update(x)
        return self.lin(x)


class ReadsCache(RequiresCache):
    _can_checkpoint_with_cache = True  # HF's mark: this layer only reads its cache


class TakesKwargs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.received: list[str] = []

    def forward(self, x: torch.Tensor, layer_past: tuple[torch.Tensor, ...] | None = None, **kwargs: object):
        self.received = sorted(kwargs)
        return self.lin(x) + (layer_past[0] if layer_past is not None else 0)


def test_a_cache_without_a_none_default_is_refused_in_forward_naming_the_option():
    block, x, cache = RequiresCache(), torch.randn(2, 4, requires_grad=True), FakeCache()
    checkpoint_block(block)
    with pytest.raises(ConfigurationError, match=r"RequiresCache.*cache=FakeCache.*use_cache=False"):
        block(x, cache)
    assert cache.calls == 0  # refused before the forward ran
    with torch.no_grad():
        block(x, cache)  # not recomputed: nothing to refuse
    assert cache.calls == 1


def test_a_block_marked_as_only_reading_its_cache_keeps_it():
    block, cache = ReadsCache(), FakeCache()
    checkpoint_block(block)
    block(torch.randn(2, 4, requires_grad=True), cache).sum().backward()
    assert cache.calls == 2  # forward and recompute both read it


def test_a_cache_only_collected_in_kwargs_is_left_out_and_read_only_pairs_are_kept():
    torch.manual_seed(0)
    block, lines = TakesKwargs(), []
    x, past = torch.randn(2, 4, requires_grad=True), (torch.randn(2, 4),)
    expected = block(x, layer_past=past)
    checkpoint_block(block, call_state=CallStateSwitch(lines.append))
    got = block(x, layer_past=past, past_key_values=FakeCache(), use_cache=True)
    got.sum().backward()
    assert torch.equal(got, expected)  # the legacy (key, value) tuple is only read: still passed
    assert block.received == ["use_cache"] and len(lines) == 1  # the cache left out, use_cache=False
    assert "past_key_values=None" in lines[0] and "use_cache=False" in lines[0]
