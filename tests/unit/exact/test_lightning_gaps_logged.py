"""The logged-values half of ``exact.lightning_gaps``: what ``self.log(..., on_epoch=True)`` accumulated, saved and
put back into a fresh ``_ResultCollection`` so that the next ``self.log`` accumulates on top, bit for bit.

Lightning refuses a second ``log`` of a key whose metadata differ ("twice ... with different arguments"), so the
entry put back must carry the very arguments ``LightningModule.log`` builds, the strategy's ``reduce`` included.
The record must also pass a weights-only ``torch.load`` (the checkpoint's pickle-free path).
"""

from __future__ import annotations

import io
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

from lightning_resume._compat.lightning_gaps import logged_results, restore_logged_results

LOSSES = [torch.tensor(v) for v in (0.7133, 0.2291, 0.9017, 0.4402, 0.3318, 0.6129)]
SAVED_AFTER = 3
LOGS = {  # name -> LightningModule.log's keyword arguments (module.py:531-547) that matter here
    "loss": {"on_step": True, "on_epoch": True, "reduce_fx": torch.mean},
    "loss_max": {"on_step": False, "on_epoch": True, "reduce_fx": torch.max},
    "samples": {"on_step": False, "on_epoch": True, "reduce_fx": torch.sum},
}


class Strategy:
    """What the restore reads of a strategy: its ``reduce`` (the sync function ``self.log`` passes) and device."""

    root_device = torch.device("cpu")

    def reduce(self, value: Any, *args: Any, **kwargs: Any) -> Any:
        return value


def _trainer(strategy: Strategy) -> Any:
    loop = SimpleNamespace(epoch_loop=SimpleNamespace(_results=_ResultCollection(training=True)))
    module = torch.nn.Module()
    return SimpleNamespace(fit_loop=loop, strategy=strategy, lightning_module=module)


def _log(trainer: Any, losses: list[torch.Tensor]) -> None:
    results = trainer.fit_loop.epoch_loop._results
    for loss in losses:
        results.batch_size = 4
        for name, kwargs in LOGS.items():
            value = torch.tensor(4.0) if name == "samples" else loss
            results.log("training_step", name, value, sync_dist_fn=trainer.strategy.reduce, **kwargs)


def _epoch_values(trainer: Any) -> dict[str, torch.Tensor]:
    return trainer.fit_loop.epoch_loop._results.metrics(on_step=False)["log"]


def _through_weights_only_load(record: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(record, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_put_back_values_accumulate_on_top_bit_for_bit() -> None:
    strategy = Strategy()
    uninterrupted, saving, resumed = _trainer(strategy), _trainer(strategy), _trainer(strategy)
    _log(uninterrupted, LOSSES)
    _log(saving, LOSSES[:SAVED_AFTER])
    record = _through_weights_only_load(logged_results(saving))
    assert restore_logged_results(resumed, record) == []
    _log(resumed, LOSSES[SAVED_AFTER:])  # would raise on metadata that differ from what log builds
    expected, got = _epoch_values(uninterrupted), _epoch_values(resumed)
    assert set(got) == {"loss_epoch", "loss_max", "samples"} == set(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_without_the_saved_values_the_epoch_covers_the_resumed_batches_only() -> None:
    strategy = Strategy()
    uninterrupted, resumed = _trainer(strategy), _trainer(strategy)
    _log(uninterrupted, LOSSES)
    _log(resumed, LOSSES[SAVED_AFTER:])
    assert not torch.equal(_epoch_values(resumed)["samples"], _epoch_values(uninterrupted)["samples"])


@pytest.mark.parametrize("field, value", [("sync_group", True), ("reduce_fx", "custom")])
def test_an_entry_that_cannot_be_rebuilt_is_named(field: str, value: Any) -> None:
    strategy = Strategy()
    saving, resumed = _trainer(strategy), _trainer(strategy)
    _log(saving, LOSSES[:SAVED_AFTER])
    record = logged_results(saving)
    record["training_step.loss"][field] = value
    assert restore_logged_results(resumed, record) == ["loss"]
    assert set(resumed.fit_loop.epoch_loop._results) == {"training_step.loss_max", "training_step.samples"}
