"""What no checkpoint makes exact is said once, at train start, naming the object and the fix; what is
fine says nothing. Unsaved (non-persistent) buffers are compared after restore."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_resume import ExactResume, ExactResumeWarning
from lightning_resume.exact.state.limits import nondeterministic_kernels
from tests.helpers.models import TinyData, TinyModel, tiny_trainer


class WithGenerator(TinyModel):
    def __init__(self) -> None:
        super().__init__()
        self.noise = torch.Generator().manual_seed(3)


class NumpyData(TinyData):
    def setup(self, stage: str) -> None:
        self.data.rng = np.random.default_rng(0)  # on the dataset the loader reads


class RunningBuffer(TinyModel):
    """``seen`` counts batches, registered non-persistent: no checkpoint holds it. ``inv`` is a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()), persistent=False)
        self.register_buffer("inv", torch.arange(4.0), persistent=False)

    def training_step(self, batch, batch_idx):
        self.seen += 1
        return super().training_step(batch, batch_idx)


def exact_warnings(fit) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit()
    return [str(w.message) for w in caught if issubclass(w.category, ExactResumeWarning)]


def fit(model, data=None, callbacks=(), **kwargs):
    lightning.seed_everything(0, verbose=False)
    ckpt_path = kwargs.pop("ckpt_path", None)
    options = dict(max_steps=4, enable_checkpointing=False, limit_val_batches=0)
    trainer = tiny_trainer([*callbacks], **{**options, **kwargs})
    trainer.fit(model, datamodule=data or TinyData(), ckpt_path=ckpt_path)
    return trainer


def test_a_generator_on_the_model_is_saved_and_one_beyond_the_walk_is_named_with_its_fix() -> None:
    model = WithGenerator()
    assert not [w for w in exact_warnings(lambda: fit(model, callbacks=[ExactResume(mtbf=None)])) if "noise" in w]
    deep = TinyModel()
    deep.a = nn.Sequential(nn.Sequential(nn.Sequential(nn.Sequential(nn.Sequential(WithGenerator())))))
    [line] = [w for w in exact_warnings(lambda: fit(deep, callbacks=[ExactResume(mtbf=None)])) if "noise" in w]
    assert "noise is a torch.Generator no checkpoint saves" in line and "state={" in line
    registered = ExactResume(mtbf=None, state={"noise": deep.a[0][0][0][0][0].noise})
    assert not [w for w in exact_warnings(lambda: fit(deep, callbacks=[registered])) if "noise" in w]


def test_a_numpy_generator_on_the_dataset_is_saved_not_named() -> None:
    lines = exact_warnings(lambda: fit(TinyModel(), NumpyData(), callbacks=[ExactResume(mtbf=None)]))
    assert not any("dataset.rng" in w for w in lines), lines


def test_max_time_is_named_and_a_plain_run_says_nothing() -> None:
    lines = exact_warnings(lambda: fit(TinyModel(), callbacks=[ExactResume(mtbf=None)], max_time="00:01:00:00"))
    assert any("max_time" in w and "max_steps" in w for w in lines), lines
    quiet = exact_warnings(lambda: fit(TinyModel(), callbacks=[ExactResume(mtbf=None, preemption=None)]))
    assert not [w for w in quiet if "not exact" in w], quiet


def test_nondeterministic_kernels_are_named_on_cuda_only() -> None:
    assert nondeterministic_kernels(torch.device("cpu")) is None
    assert "deterministic=True" in (nondeterministic_kernels(torch.device("cuda")) or "")
    torch.use_deterministic_algorithms(True)
    try:
        assert nondeterministic_kernels(torch.device("cuda")) is None
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_non_persistent_buffer_training_changes_is_reported_after_resume(tmp_path: Path) -> None:
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    fit(RunningBuffer(), callbacks=[ExactResume(mtbf=None), ckpt], enable_checkpointing=True)
    path = str(tmp_path / "epoch=0-step=2.ckpt")
    exact = ExactResume(mtbf=None)
    lines = exact_warnings(lambda: fit(RunningBuffer(), callbacks=[exact], ckpt_path=path))
    assert exact.resume_report.unsaved_buffers_differ == ("seen",)  # "inv" is rebuilt equal: no word of it
    assert any("non-persistent buffers ['seen']" in w and "persistent=True" in w for w in lines), lines
    assert exact.resume_report.exact is True  # the checkpointed state itself came back whole


@pytest.fixture(autouse=True)
def _cpu_threads() -> None:
    torch.set_num_threads(1)
