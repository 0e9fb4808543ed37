"""Adding ``ExactResume()`` leaves the user's training loaders as users see them (issue 23, item 4): the same
batch order and random draws as without it, the same loader and sampler objects, every loader Lightning
accepts still accepted, a fresh run never refused, and checkpoints holding what they hold without it."""

from __future__ import annotations

import multiprocessing as mp
import warnings
from pathlib import Path
from typing import Any, Iterator
from unittest.mock import Mock, call

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from lightning_resume import ExactResume
from lightning_resume.errors import ExactResumeWarning

NOT_EXACT = "resume will not be exact"


class Recorder(BoringModel):
    """Records every batch it trains on and one draw of the global RNG per step (dropout's stream)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []
        self.draws: list[torch.Tensor] = []
        self.loaders: list[Any] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.seen.append(torch.stack(batch) if isinstance(batch, list) else batch.detach().clone())
        self.draws.append(torch.rand(1))
        self.loaders.append(self.trainer.train_dataloader)
        return super().training_step(self.seen[-1], batch_idx)


def _trainer(tmp_path: Path, exact: bool, **kwargs: Any) -> Trainer:
    options: dict[str, Any] = dict(
        default_root_dir=tmp_path, max_epochs=3, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
    )  # fmt: skip
    callbacks = kwargs.pop("callbacks", None) or []
    options.update(kwargs)
    return Trainer(callbacks=[*callbacks, ExactResume(mtbf=None)] if exact else callbacks, **options)


def _fit(tmp_path: Path, exact: bool, loader: Any, **kwargs: Any) -> Recorder:
    seed_everything(7)
    model = Recorder()
    _trainer(tmp_path, exact, **kwargs).fit(model, loader)
    return model


@pytest.mark.parametrize("num_workers", [0, 2])
def test_seeded_shuffle_trains_the_same_batches_and_draws_as_without_the_callback(
    tmp_path: Path, num_workers: int
) -> None:
    def run(exact: bool) -> Recorder:
        seed_everything(7)
        loader = DataLoader(RandomDataset(32, 24), batch_size=4, shuffle=True, num_workers=num_workers)
        return _fit(tmp_path / str(exact), exact, loader)

    stock, with_callback = run(False), run(True)
    assert len(stock.seen) == 18  # 3 epochs of 6 batches
    assert all(torch.equal(a, b) for a, b in zip(stock.seen, with_callback.seen, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(stock.draws, with_callback.draws, strict=True))


def test_a_generator_loader_trains_and_is_named_once(tmp_path: Path) -> None:
    with pytest.warns(ExactResumeWarning, match="train loader 0 is a generator") as record:
        model = _fit(tmp_path, True, (torch.randn(2, 32) for _ in range(4)), max_epochs=1)
    assert len(model.seen) == 4
    assert sum(NOT_EXACT in str(w.message) for w in record) == 1


def test_a_list_of_batches_trains(tmp_path: Path) -> None:
    # Lightning takes a list as one iterable per element (CombinedLoader): three loaders of rows
    with pytest.warns(ExactResumeWarning, match="train loader 2 is a Tensor"):
        model = _fit(tmp_path, True, [torch.randn(2, 32) for _ in range(3)], max_epochs=1)
    assert len(model.seen) == 2


class MyLoader(DataLoader):
    pass


def test_a_dataloader_subclass_is_left_as_it_is_and_a_fresh_run_is_not_refused(tmp_path: Path) -> None:
    loader = MyLoader(RandomDataset(32, 8), batch_size=2)
    with pytest.warns(ExactResumeWarning, match="train loader 0 is a MyLoader"):
        model = _fit(tmp_path, True, loader, max_epochs=1)
    assert len(model.seen) == 4 and all(seen is loader for seen in model.loaders)


def test_checkpoint_holds_what_it_holds_without_the_callback_plus_its_entry(tmp_path: Path) -> None:
    def saved(exact: bool) -> dict[str, Any]:
        trainer = _trainer(tmp_path / str(exact), exact, max_epochs=1, enable_checkpointing=True)
        seed_everything(7)
        trainer.fit(BoringModel(), DataLoader(RandomDataset(32, 8), batch_size=2, shuffle=True))
        (path,) = (tmp_path / str(exact) / "checkpoints").glob("*.ckpt")
        return torch.load(path, weights_only=False)

    stock, with_callback = saved(False), saved(True)
    assert with_callback["loops"]["fit_loop"]["state_dict"] == stock["loops"]["fit_loop"]["state_dict"]
    assert set(with_callback["callbacks"]) - set(stock["callbacks"]) == {"ExactResume"}


def test_the_users_loader_and_sampler_are_the_ones_trained_on(tmp_path: Path) -> None:
    ds = RandomDataset(32, 8)
    sampler = RandomSampler(ds)
    sampler.set_epoch = Mock()
    loader = DataLoader(ds, batch_sampler=BatchSampler(sampler, 2, True))
    model = _fit(tmp_path, True, loader, max_epochs=2)
    assert len(model.seen) == 8 and all(seen is loader for seen in model.loaders)
    assert loader.batch_sampler.sampler is sampler
    assert sampler.set_epoch.mock_calls == [call(0), call(1)]
    assert type(loader) is DataLoader and type(sampler) is RandomSampler  # put back after fit


def test_a_plain_sampler_keeps_its_set_epoch(tmp_path: Path) -> None:
    ds = RandomDataset(32, 8)
    sampler = RandomSampler(ds)
    sampler.set_epoch = Mock()
    _fit(tmp_path, True, DataLoader(ds, sampler=sampler), max_epochs=2, limit_train_batches=1)
    assert sampler.set_epoch.mock_calls == [call(0), call(1)]


class QueueDataset(IterableDataset):
    def __init__(self, queue: Any) -> None:
        self.queue = queue

    def __iter__(self) -> Iterator[torch.Tensor]:
        for _ in range(5):
            yield self.queue.get(timeout=60)


def test_an_iterable_reading_a_queue_is_not_read_again_on_resume(tmp_path: Path) -> None:
    queue = mp.get_context("fork").Queue()
    for _ in range(20):
        queue.put(torch.rand(32))
    loader = DataLoader(QueueDataset(queue), num_workers=1, batch_size=None)
    trainer = _trainer(tmp_path, True, max_epochs=2)
    trainer.fit(BoringModel(), loader)
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    model = Recorder()
    _trainer(tmp_path, True, max_epochs=4).fit(model, loader, ckpt_path=tmp_path / "model.ckpt")
    assert len(model.seen) == 10


def test_no_torchdata_deprecation_warning(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _fit(tmp_path, True, DataLoader(RandomDataset(32, 8), batch_size=2, shuffle=True), max_epochs=1)
    assert not [w for w in record if "set_vital" in str(w.message)]
    assert not [w for w in record if "train loader" in str(w.message)]


@pytest.mark.parametrize("generator", [False, True], ids=["global_seed", "own_generator"])
def test_a_shuffled_plain_loader_resumes_mid_epoch_on_the_uninterrupted_order(tmp_path: Path, generator: bool) -> None:
    def run(root: Path, ckpt_path: Any = None, **kwargs: Any) -> Recorder:
        seed_everything(7)
        ds = RandomDataset(32, 24)
        g = torch.Generator().manual_seed(11) if generator else None
        loader = DataLoader(ds, batch_size=4, sampler=RandomSampler(ds, generator=g))
        every = ModelCheckpoint(dirpath=root, every_n_train_steps=10, save_top_k=-1, filename="{step}")
        trainer = _trainer(root, True, callbacks=[every], enable_checkpointing=True, **kwargs)
        model = Recorder()
        trainer.fit(model, loader, ckpt_path=ckpt_path)
        return model

    whole = run(tmp_path / "a")
    resumed = run(tmp_path / "c", ckpt_path=tmp_path / "a" / "step=10.ckpt")
    assert len(whole.seen) == 18 and len(resumed.seen) == 8  # resumed in epoch 1 (6 batches an epoch)
    assert all(torch.equal(a, b) for a, b in zip(whole.seen[10:], resumed.seen, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(whole.draws[10:], resumed.draws, strict=True))
