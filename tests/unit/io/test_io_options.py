"""``SafetensorsCheckpointIO``'s options (``save``, ``writer``, ``remote``) from Python and from YAML, every
combination working without a cross-check, and the seams other parts reach it through (``protocols``): the
memory tier's staging reuse and the in-place load, with a fake IO that has them and a plain IO that has not."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import lightning
import pytest
import torch
import yaml
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from lightning_resume import SafetensorsCheckpointIO
from lightning_resume.errors import ConfigurationError
from lightning_resume.format import read
from lightning_resume.io.options import SAVE_MODES, WRITERS, RemoteOptions
from lightning_resume.memory.tier import MemoryTier
from lightning_resume.protocols import (
    InPlaceLoading,
    StagingLender,
    checkpoint_io_as,
    loaded_in_place,
    offer_module,
)
from tests.helpers.models import TINY_TRAINER, TinyData, TinyModel


def _checkpoint(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    return {"global_step": step, "state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()]}


def _clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize(("save", "writer"), list(itertools.product(SAVE_MODES, WRITERS)))
def test_every_combination_saves_the_state_at_the_save(tmp_path: Path, save: str, writer: str) -> None:
    """No pair of valid values is refused, and each holds the state as it was when ``save_checkpoint`` was called,
    though the optimizer steps right after it (the overlapped copy's barrier, a background write)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    io = SafetensorsCheckpointIO(save=save, writer=writer)  # type: ignore[arg-type]
    try:
        for step in range(2):  # the second save finds the optimizer known to the overlapped copy
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            expected = _clone(_checkpoint(model, opt, step))
            io.save_checkpoint(_checkpoint(model, opt, step), tmp_path / f"{step}.ckpt")
            assert io.write_in_flight() is (save != "sync")
            model(torch.randn(2, 8)).sum().backward()
            opt.step()  # writes the weights and moments in place while the write may still run
            io.wait()
            assert _same(read.load_file(str(tmp_path / f"{step}.ckpt")).checkpoint, expected)
    finally:
        io.teardown()


def test_invalid_options_are_named_together() -> None:
    with pytest.raises(ConfigurationError) as err:
        SafetensorsCheckpointIO(save="background", writer="fork", on_error="ignore", remote={"x": 1})  # type: ignore[arg-type]
    message = str(err.value)
    assert "save='background' is not supported; use one of ['sync', 'async', 'overlapped']" in message
    assert "writer='fork' is not supported; use one of ['thread', 'process']" in message
    assert "on_error='ignore'" in message and "remote={'x': 1} must be a RemoteOptions" in message


def test_remote_options_name_every_bad_field() -> None:
    with pytest.raises(ConfigurationError) as err:
        RemoteOptions(max_load_bytes=0, upload_part_size=1024, upload_concurrency=0)
    assert [p.split("=")[0] for p in err.value.problems] == ["max_load_bytes", "upload_part_size", "upload_concurrency"]


CONFIG = """
trainer:
  plugins:
    - class_path: lightning_resume.SafetensorsCheckpointIO
      init_args:
        save: overlapped
        writer: thread
        on_error: warn
        remote:
          max_load_bytes: 8000000000
          upload_part_size: 33554432
          upload_concurrency: 4
"""


def test_the_options_build_from_yaml_with_lightning_cli_and_train(tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI

    config = yaml.safe_load(CONFIG)
    callback = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint"}
    callback["init_args"] = {"dirpath": str(tmp_path / "ckpt"), "every_n_train_steps": 2, "save_top_k": -1}
    config["trainer"].update(TINY_TRAINER, max_steps=4, callbacks=[callback], default_root_dir=str(tmp_path))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    lightning.seed_everything(0, verbose=False)
    run = LightningCLI(TinyModel, TinyData, args=["fit", "--config", str(path)], save_config_callback=None)
    io = run.trainer.strategy.checkpoint_io
    assert isinstance(io, SafetensorsCheckpointIO)
    assert (io.save, io.writer, io.on_error) == ("overlapped", "thread", "warn")
    assert io.remote == RemoteOptions(max_load_bytes=8_000_000_000, upload_part_size=32 << 20, upload_concurrency=4)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    assert read.load_file(str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt")).checkpoint["global_step"] == 4


# ---------------------------------------------------------------------------------------------- the seams


@dataclass(frozen=True)
class FakeLoan:
    overlapped: bool
    newest: Callable[[], Any]


class LendingIO(TorchCheckpointIO):
    """Not our plugin: it lends staging and loads in place only by having the protocols' methods."""

    def __init__(self, offer: Any) -> None:
        self.offer, self.lent, self.offered = offer, 0, []  # type: ignore[var-annotated]

    def lend_staging(self) -> Optional[FakeLoan]:
        self.lent += 1
        return FakeLoan(True, lambda: self.offer)

    def load_into(self, module: Optional[torch.nn.Module]) -> None:
        self.offered.append(module)

    def loaded_in_place(self) -> dict:
        return {"net.weight": ("xxh3-128", "00")}

    def in_place_target(self) -> None:
        return None


def test_the_memory_tier_reuses_the_staging_of_any_io_that_lends_it(tmp_path: Path) -> None:
    offer = object()
    io = LendingIO(offer)
    trainer = Trainer(plugins=[io], logger=False, enable_progress_bar=False, enable_model_summary=False)
    tier = MemoryTier(str(tmp_path / "shm"))
    tier.setup(trainer, str(tmp_path / "ckpt"))
    assert io.lent == 1 and tier.offer(trainer) is offer
    assert tier.store is not None and tier.store.last_copy is None
    assert tier.store._saver is not None and tier.store._saver.overlapped  # copies as the lender does


def test_a_plain_io_gets_no_staging_reuse_and_no_in_place_load(tmp_path: Path) -> None:
    trainer = Trainer(plugins=[TorchCheckpointIO()], logger=False, enable_progress_bar=False)
    assert not isinstance(trainer.strategy.checkpoint_io, (StagingLender, InPlaceLoading))
    tier = MemoryTier(str(tmp_path / "shm"))
    tier.setup(trainer, str(tmp_path / "ckpt"))
    assert tier.offer(trainer) is None
    assert tier.store is not None and tier.store._saver is not None and not tier.store._saver.overlapped
    offer_module(trainer, torch.nn.Linear(2, 2))  # nothing to hand it to: no error either
    assert loaded_in_place(trainer) == {}


def test_the_in_place_seam_finds_any_io_that_has_it_also_inside_a_wrapper() -> None:
    io = LendingIO(None)
    module = torch.nn.Linear(2, 2)
    trainer = Trainer(plugins=[AsyncCheckpointIO(io)], logger=False, enable_progress_bar=False)
    assert checkpoint_io_as(trainer, InPlaceLoading) is io
    offer_module(trainer, module)
    offer_module(trainer, None)
    assert io.offered == [module, None]
    assert loaded_in_place(trainer) == {"net.weight": ("xxh3-128", "00")}


def test_our_plugin_lends_staging_only_when_it_stages() -> None:
    assert SafetensorsCheckpointIO().lend_staging() is None  # a sync save on the training thread stages nothing
    io = SafetensorsCheckpointIO(save="overlapped")
    try:
        loan = io.lend_staging()
        assert loan is not None and loan.overlapped and loan.newest() is None  # no save yet
    finally:
        io.teardown()


def test_a_fit_with_exact_resume_reads_the_weights_in_place_through_the_seam(tmp_path: Path) -> None:
    """End to end: the callback finds the IO by the protocol, hands the module over, and the restore reads into it."""
    from lightning_resume import ExactResume

    def fit(ckpt_path: Optional[str]) -> Trainer:
        lightning.seed_everything(0, verbose=False)
        trainer = Trainer(
            **{**TINY_TRAINER, "max_steps": 4 if ckpt_path is None else 6},
            callbacks=[ExactResume(mtbf=None), ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2)],
            plugins=[SafetensorsCheckpointIO()],
        )
        trainer.fit(TinyModel(), datamodule=TinyData(), ckpt_path=ckpt_path)
        return trainer

    fit(None)
    resumed = fit("last")
    io = resumed.strategy.checkpoint_io
    assert isinstance(io, SafetensorsCheckpointIO)
    assert set(loaded_in_place(resumed)) == {"net.weight", "net.bias"}
