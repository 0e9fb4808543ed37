"""Adding ``ExactResume()`` to a working Trainer changes nothing else (issue 23.4): no file where Lightning
writes none, no warning where nothing is lost, Lightning's SIGTERM behaviour and a user's handler kept."""

from __future__ import annotations

import os
import pickle
import signal
import warnings
from unittest.mock import Mock, call

import lightning
import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_resume import ExactResume
from tests.helpers.filesystem import listing
from tests.helpers.models import TinyData, TinyModel, tiny_trainer

pytestmark = pytest.mark.timeout(300)


def _ours(caught) -> list[str]:
    return [str(w.message) for w in caught if type(w.message).__module__.startswith("lightning_resume")]


def test_fast_dev_run_writes_no_file(tmp_path):
    os.chdir(tmp_path)
    Trainer(fast_dev_run=True, callbacks=[ExactResume()], logger=False, enable_progress_bar=False).fit(BoringModel())
    assert listing(tmp_path) == []  # Lightning writes nothing under fast_dev_run, and neither do we


def test_the_failure_history_is_no_file_beside_the_checkpoints(tmp_path):
    ckpt = tmp_path / "ckpt"
    lightning.seed_everything(0, verbose=False)
    tiny_trainer([ExactResume(), ModelCheckpoint(dirpath=ckpt)], max_epochs=1).fit(TinyModel(), TinyData())
    assert listing(ckpt) == ["epoch=0-step=8.ckpt"]  # exactly what Lightning writes: the history is inside it


@pytest.mark.parametrize("checkpointing", [True, False])
def test_a_plain_trainer_with_the_callback_warns_nothing(tmp_path, checkpointing):
    os.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(
            max_epochs=1, callbacks=[ExactResume()], enable_checkpointing=checkpointing, enable_progress_bar=False
        ).fit(BoringModel())
    assert _ours(caught) == []


def test_sigterm_snapshots_then_lightning_raises_and_the_users_handler_runs(tmp_path):
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:

        class Term(Callback):
            def on_train_batch_start(self, trainer, *args):
                if trainer.global_step == 3:
                    os.kill(os.getpid(), signal.SIGTERM)

        lightning.seed_everything(0, verbose=False)
        ckpt = ModelCheckpoint(dirpath=tmp_path, save_top_k=0)
        trainer = tiny_trainer([ExactResume(mtbf=None), ckpt, Term()], max_steps=20)
        with pytest.raises(SIGTERMException):
            trainer.fit(TinyModel(), TinyData())
        assert seen == [signal.SIGTERM]  # the user's handler, composed by Lightning's, ran once
        assert listing(tmp_path) == ["last-snapshot-step=000000004.ckpt"]  # durable before Lightning acted
        assert trainer.global_step == 4
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_checkpoint_saved_after_fit_loads_for_evaluation_without_a_word(tmp_path):
    lightning.seed_everything(0, verbose=False)
    trainer = tiny_trainer([ExactResume(mtbf=None)], max_epochs=1, enable_checkpointing=False)
    trainer.fit(TinyModel(), TinyData())
    trainer.save_checkpoint(tmp_path / "after.ckpt")  # outside fit: no training position in it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_trainer([ExactResume(mtbf=None)]).validate(TinyModel(), TinyData(), ckpt_path=tmp_path / "after.ckpt")
    assert _ours(caught) == []
    with pytest.warns(UserWarning, match="saved outside fit"):  # training from it is not exact: said so
        tiny_trainer([ExactResume(mtbf=None)], max_epochs=2, enable_checkpointing=False).fit(
            TinyModel(), TinyData(), ckpt_path=tmp_path / "after.ckpt"
        )


@pytest.mark.parametrize("trigger", [{}, {"every_n_train_steps": 8}])  # in on_train_epoch_end; on its last batch
def test_resuming_at_an_epoch_end_with_the_progress_bar_warns_nothing(tmp_path, trigger):
    lightning.seed_everything(0, verbose=False)
    first = [ExactResume(mtbf=None), ModelCheckpoint(dirpath=tmp_path, **trigger)]
    tiny_trainer(first, max_epochs=1).fit(TinyModel(), TinyData())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callbacks = [ExactResume(mtbf=None), ModelCheckpoint(dirpath=tmp_path, **trigger)]
        trainer = tiny_trainer(callbacks, max_steps=16, enable_progress_bar=True)
        trainer.fit(TinyModel(), TinyData(), ckpt_path=str(tmp_path / "epoch=0-step=8.ckpt"))
    assert _ours(caught) == [] and trainer.global_step == 16


def test_a_resume_from_a_save_at_the_validation_after_an_epochs_last_batch_counts_epochs_as_lightning(tmp_path):
    """Lightning's own resume-parity case: the epoch is finished by Lightning, its next start counted once."""

    def run(max_epochs: int, exact: bool, ckpt_path=None) -> Trainer:
        callbacks = [ModelCheckpoint(dirpath=tmp_path / str(exact), save_last=True, save_top_k=-1)]
        trainer = Trainer(
            max_epochs=max_epochs, limit_train_batches=2, limit_val_batches=2, val_check_interval=2,
            callbacks=callbacks + ([ExactResume(mtbf=None)] if exact else []), logger=False,
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(BoringModel(), ckpt_path=ckpt_path)
        return trainer

    totals = []
    for exact in (False, True):
        run(2, exact)
        resumed = run(4, exact, ckpt_path=str(tmp_path / str(exact) / "last.ckpt"))
        totals.append(resumed.fit_loop.epoch_progress.total.state_dict())
    assert totals[1] == totals[0]


def test_a_loader_that_saves_no_position_resumes_as_lightning_does_and_says_so(tmp_path):
    class Batches:  # an iterable that is no DataLoader and has no state: no position to save
        def __iter__(self):
            return (torch.ones(2, 32) * i for i in range(3))

        def __len__(self):
            return 3

    batches = Batches()
    kwargs = dict(default_root_dir=tmp_path, max_epochs=1, logger=False, enable_progress_bar=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    Trainer(callbacks=[ExactResume(mtbf=None), ckpt], **kwargs).fit(BoringModel(), batches)
    exact = ExactResume(mtbf=None)
    with pytest.warns(UserWarning, match="resuming approximately"):
        Trainer(callbacks=[exact], enable_checkpointing=False, **kwargs).fit(
            BoringModel(), batches, ckpt_path=tmp_path / "epoch=0-step=1.ckpt"
        )
    assert exact.resume_report.exact is False and any("Batches" in d for d in exact.resume_report.differences)


def test_ddp_spawn_can_send_the_trainers_methods_to_its_processes(tmp_path):
    """``ddp_spawn`` pickles ``trainer._fit_impl`` (strategies/launchers/multiprocessing.py:125-139), a bound
    method pickled by its name; the process it starts looks that name up on its Trainer. The methods
    ``ExactResume`` routes through its own functions keep Lightning's names, so that lookup finds them."""
    trainer = Trainer(default_root_dir=tmp_path, callbacks=[ExactResume(), ModelCheckpoint(dirpath=tmp_path)])
    sent = [trainer._fit_impl, trainer._checkpoint_connector._select_ckpt_path,
            trainer._checkpoint_connector._parse_ckpt_path, trainer.checkpoint_callback._find_last_checkpoints]  # fmt: skip
    assert Trainer._fit_impl.__module__ == "lightning_resume._compat.lightning"  # routed through ours
    for method in sent:
        received = pickle.loads(pickle.dumps(method))
        assert received.__func__ is method.__func__  # the spawned process calls the same function


def test_a_mock_the_module_holds_is_neither_called_nor_reported(tmp_path):
    """Lightning's own tests wrap a module's hooks in ``Mock(wraps=...)`` and assert the exact calls; a mock has
    every attribute, ``state_dict`` included, but no state: the walk for user state leaves it alone."""
    model, tracker = BoringModel(), Mock()
    model.val_dataloader = Mock(wraps=model.val_dataloader)
    tracker.attach_mock(model.val_dataloader, "val_dataloader")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(
            default_root_dir=tmp_path, max_epochs=1, limit_train_batches=2, limit_val_batches=1, logger=False,
            enable_progress_bar=False, callbacks=[ExactResume()],
        ).fit(model)  # fmt: skip
    assert tracker.mock_calls == [call.val_dataloader()]  # Lightning's one call, no state_dict()
    assert _ours(caught) == []
