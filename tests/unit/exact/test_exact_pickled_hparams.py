"""Checkpoints that hold pickled objects (issue 39.3): ``save_hyperparameters()`` over an ``nn.Module`` or a
``functools.partial`` argument, as the lightning-hydra-template writes a module.

``fit(ckpt_path="last")`` with ``ExactResume`` reads the candidates as the user's ``fit(..., weights_only=...)``
says: by default such a checkpoint is refused naming what it holds and the two fixes (never "convert it in a
sandbox"), with ``weights_only=False`` it resumes as plain Lightning does. ``SafetensorsCheckpointIO`` refuses
such hyper-parameters when ``fit`` starts, not at a save hours in. The killed-and-resumed run in a fresh
process is ``tests/integration/test_exact_pickled_hparams.py``.
"""

from __future__ import annotations

import functools
import io

import lightning
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_resume import ExactResume, SafetensorsCheckpointIO
from lightning_resume.errors import NoLoadableCheckpointError, PickledCheckpointError, UnencodableValueError
from lightning_resume.format.legacy import load_legacy
from tests.helpers.filesystem import listing
from tests.helpers.models import TinyData, TinyModel, tiny_trainer

pytestmark = pytest.mark.timeout(300)


class PartialOptimizer(TinyModel):
    """The optimizer as a ``functools.partial`` ``__init__`` argument, stored by ``save_hyperparameters()``."""

    def __init__(self, optimizer: functools.partial = functools.partial(torch.optim.SGD, lr=0.05)) -> None:
        super().__init__()
        self.save_hyperparameters()

    def configure_optimizers(self):
        return self.hparams.optimizer(params=self.parameters())


class ModuleArgument(TinyModel):
    """The network as an ``nn.Module`` ``__init__`` argument, stored by ``save_hyperparameters()``."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = net


def _fit(model, callbacks, ckpt_path=None, max_epochs=2, **fit_kwargs):
    lightning.seed_everything(0, verbose=False)
    trainer = tiny_trainer(callbacks, max_epochs=max_epochs, limit_train_batches=4)
    trainer.fit(model, datamodule=TinyData(), ckpt_path=ckpt_path, **fit_kwargs)
    return trainer


def test_last_refuses_a_partial_naming_it_and_both_fixes_and_resumes_with_weights_only_false(tmp_path):
    _fit(PartialOptimizer(), [ExactResume(mtbf=None), ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    skipped = pytest.warns(UserWarning, match="ckpt_path='last': ")  # each file named, also when the search raises
    with skipped, pytest.raises(NoLoadableCheckpointError) as refused:
        _fit(PartialOptimizer(), [ExactResume(mtbf=None), ModelCheckpoint(dirpath=tmp_path)], "last", 3)
    said = str(refused.value)
    assert "functools.partial" in said and "torch.optim.sgd.SGD" in said
    assert "save_hyperparameters(ignore=" in said and "weights_only=False" in said and "sandbox" not in said
    assert set(refused.value.pickled) == {str(tmp_path / "last.ckpt"), str(tmp_path / "epoch=1-step=8.ckpt")}
    exact = ExactResume(mtbf=None)
    trainer = _fit(PartialOptimizer(), [exact, ModelCheckpoint(dirpath=tmp_path)], "last", 3, weights_only=False)
    assert exact.resume_report.step == 8 and trainer.global_step == 12


def test_safetensors_io_refuses_module_and_partial_hparams_when_fit_starts(tmp_path):
    class Both(ModuleArgument):
        def __init__(self, net: nn.Module, optimizer: functools.partial) -> None:
            super().__init__(net)
            self.save_hyperparameters()

    model = Both(nn.Linear(4, 1), functools.partial(torch.optim.SGD, lr=0.05))
    callbacks = [ExactResume(mtbf=None), ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1)]
    lightning.seed_everything(0, verbose=False)
    trainer = tiny_trainer(callbacks, max_epochs=1, limit_train_batches=4, plugins=[SafetensorsCheckpointIO()])
    with pytest.raises(UnencodableValueError, match=r"hyper_parameters\.net") as refused:
        trainer.fit(model, datamodule=TinyData())
    assert "save_hyperparameters(ignore=['net', 'optimizer'])" in str(refused.value)
    assert trainer.global_step == 0 and listing(tmp_path) == []  # refused before training, not at a save


def test_safetensors_io_without_a_resume_callback_refuses_at_the_first_save_with_the_same_advice(tmp_path):
    trainer = tiny_trainer(
        [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1)], max_epochs=1, plugins=[SafetensorsCheckpointIO()]
    )
    with pytest.raises(UnencodableValueError, match=r"hyper_parameters\.net") as refused:
        trainer.fit(ModuleArgument(nn.Linear(4, 1)), datamodule=TinyData())
    assert "save_hyperparameters(ignore=['net'])" in str(refused.value)
    assert trainer.global_step == 1 and listing(tmp_path) == []


def test_numpy_scalars_load_weights_only(tmp_path):
    """What an optimizer or scheduler may keep (``numpy.float64`` and kin): rebuilt from a dtype and bytes."""
    values = {"lr": np.float64(0.1), "step": np.int64(3), "beta": np.float32(0.9), "flag": np.bool_(True)}
    buffer = io.BytesIO()
    torch.save({"optimizer_states": [values]}, buffer)
    loaded = load_legacy("mem.ckpt", io.BytesIO(buffer.getvalue()))
    assert loaded["optimizer_states"][0] == values
    assert all(type(v) is type(values[k]) for k, v in loaded["optimizer_states"][0].items())


def test_safetensors_io_reads_a_pickled_legacy_file_as_weights_only_says(tmp_path):
    """The plugin resolving "last" and loading: refused by default, read in full when the user trusts it."""
    path = str(tmp_path / "last.ckpt")
    torch.save({"global_step": 3, "hyper_parameters": {"optimizer": functools.partial(torch.optim.SGD, lr=0.1)}}, path)
    plugin, skipped = SafetensorsCheckpointIO(), []
    assert plugin.resolve_newest([path], skipped=skipped.append) is None
    assert "functools.partial" in skipped[0] and "save_hyperparameters(ignore=" in skipped[0]
    with pytest.raises(PickledCheckpointError, match="functools.partial"):
        plugin.load_checkpoint(path)
    assert plugin.resolve_newest([path], skipped=skipped.append, weights_only=False) == path
    assert plugin.load_checkpoint(path, weights_only=False)["hyper_parameters"]["optimizer"].keywords == {"lr": 0.1}
