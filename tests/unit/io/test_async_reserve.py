"""Staging memory reserved ahead of the first async save (issue 16.3, the first save's blocked time).

The first save of a process used to fault in every page of a fresh pool on the training thread (6-8x a
memcpy of the state here). ``ExactResume`` now has the async ``CheckpointIO`` reserve and touch the pool on
its worker after the first optimizer step; these tests check that the first save then finds the pool
allocated, that a reservation too small or a failed one changes nothing but speed, and that only a
process that writes checkpoints reserves.
"""

from __future__ import annotations

import logging

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_resume import ExactResume, SafetensorsCheckpointIO
from lightning_resume.format import read
from lightning_resume.staging.buffers import HostBuffers
from tests.helpers.compare import assert_same
from tests.helpers.models import TinyMLP as Tiny
from tests.helpers.models import io_trainer as _trainer


def _state(n: int = 4, numel: int = 1 << 16) -> dict:
    return {f"t{i}": torch.randn(numel) for i in range(n)}


def test_a_reserved_pool_is_the_one_the_first_fill_uses() -> None:
    tensors = _state()
    buffers = HostBuffers()
    buffers.reserve(sum(t.nbytes for t in tensors.values()) + (1 << 20))
    assert buffers.allocations == 1 and buffers.capacity >= sum(t.nbytes for t in tensors.values())
    staged = buffers.prepare(tensors)
    buffers.fill(staged, tensors)
    assert buffers.allocations == 1  # no second allocation: the first save copies into touched memory
    for name, t in tensors.items():
        assert torch.equal(staged[name], t)


def test_a_reservation_too_small_only_means_the_first_fill_allocates() -> None:
    tensors = _state()
    buffers = HostBuffers()
    buffers.reserve(1024)
    staged = buffers.prepare(tensors)
    buffers.fill(staged, tensors)
    assert buffers.allocations == 2
    for name, t in tensors.items():
        assert torch.equal(staged[name], t)


class ReservingIO(SafetensorsCheckpointIO):
    """An async IO that records each reservation asked of it and how many pools were allocated by then."""

    def __init__(self) -> None:
        super().__init__(save="async")
        self.reserved: list[int] = []
        self.allocations_before: list[int] = []

    @property
    def allocations(self) -> int:
        assert self._saver is not None
        return self._saver.buffers.allocations

    def reserve(self, nbytes: int, pinned: bool = False) -> None:
        self.reserved.append(nbytes)
        self.allocations_before.append(self.allocations)
        super().reserve(nbytes, pinned)


class ImpossibleReservationIO(SafetensorsCheckpointIO):
    """An async IO whose every reservation asks for more memory than any machine has: the allocation fails."""

    def __init__(self) -> None:
        super().__init__(save="async")

    def reserve(self, nbytes: int, pinned: bool = False) -> None:
        super().reserve(1 << 62, pinned)


def test_exact_resume_reserves_once_before_the_first_async_save(tmp_path) -> None:
    io = ReservingIO()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    model = Tiny()
    _trainer(tmp_path, 6, [ExactResume(mtbf=None, preemption=None), ckpt], io).fit(model)
    assert len(io.reserved) == 1 and io.allocations_before == [0]  # once, after step 1, before any save allocated
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert io.reserved[0] >= 3 * params  # weights plus Adam's two moments
    assert io.allocations == 1  # every save used the reserved pool
    loaded = read.load_file(str(tmp_path / "epoch=0-step=6.ckpt")).checkpoint
    assert_same(loaded["state_dict"], model.state_dict())


def test_a_failed_reservation_is_logged_and_saves_still_work(tmp_path, caplog) -> None:
    io = ImpossibleReservationIO()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    with caplog.at_level(logging.WARNING, logger="lightning_resume.staging.async_save"):
        _trainer(tmp_path, 4, [ExactResume(mtbf=None, preemption=None), ckpt], io).fit(Tiny())
    assert "could not reserve" in caplog.text
    read.load_file(str(tmp_path / "epoch=0-step=3.ckpt"))


def test_no_checkpoint_callback_no_reservation(tmp_path) -> None:
    io = ReservingIO()
    trainer = Trainer(
        default_root_dir=str(tmp_path), max_steps=3, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1,
        callbacks=[ExactResume(mtbf=None, preemption=None)], plugins=[io],
    )  # fmt: skip
    trainer.fit(Tiny())
    assert io.reserved == [] and io.allocations == 0  # nothing will be saved: no memory held for it
