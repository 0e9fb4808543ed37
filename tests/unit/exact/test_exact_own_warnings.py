"""Lightning's warnings that contradict ``ExactResume`` are replaced by one line of ours where it handles the case,
and only there (issue 39.6); a ``pytorch_lightning`` Trainer is refused, naming the import that fixes it."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Optional

import lightning
import pytest
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_resume import ExactResume
from lightning_resume.errors import ConfigurationError
from tests.helpers.models import TinyData, TinyModel, tiny_trainer

pytestmark = pytest.mark.timeout(300)

UNRESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable"
SAVE_LAST_HINT = "HINT: Set `ModelCheckpoint(..., save_last=True)`"
NO_LAST = '.fit(ckpt_path="last") is set, but there is no last checkpoint available. No checkpoint will be loaded.'


def fit(ckpt_dir: Path, exact: bool, steps: int, ckpt_path: Optional[str] = None) -> list[str]:
    """A seeded fit of 8 batches an epoch saving every 3 steps (``save_last=True``); the warnings it raised."""
    lightning.seed_everything(0, verbose=False)
    callbacks: list[Callback] = [
        ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1, save_last=True)
    ]
    callbacks += [ExactResume(mtbf=None)] if exact else []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_trainer(callbacks, max_steps=steps).fit(TinyModel(), TinyData(), ckpt_path=ckpt_path)
    return [str(w.message) for w in caught]


def _has(caught: list[str], text: str) -> bool:
    return any(text in message for message in caught)


def test_a_mid_epoch_resume_says_the_loaders_go_on_instead_of_lightnings_warning(tmp_path, caplog):
    fit(tmp_path, exact=True, steps=3)
    with caplog.at_level(logging.INFO):
        caught = fit(tmp_path, exact=True, steps=6, ckpt_path=str(tmp_path / "epoch=0-step=3.ckpt"))
    assert not _has(caught, UNRESUMABLE)
    ours = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ExactResume: resumed at step")]
    assert ours == ["ExactResume: resumed at step 3; every train loader goes on from its saved position"]
    assert all(r.levelno == logging.INFO for r in caplog.records if r.getMessage() in ours)


def test_lightnings_loader_warning_stays_where_exact_resume_does_not_resume(tmp_path):
    fit(tmp_path / "exact", exact=True, steps=3)
    fit(tmp_path / "exact", exact=True, steps=6, ckpt_path=str(tmp_path / "exact" / "epoch=0-step=3.ckpt"))
    fit(tmp_path / "stock", exact=False, steps=3)  # then, in the same process, a run without ExactResume
    caught = fit(tmp_path / "stock", exact=False, steps=6, ckpt_path=str(tmp_path / "stock" / "epoch=0-step=3.ckpt"))
    assert _has(caught, UNRESUMABLE)  # scoped to the resume ExactResume handled: no filter was left behind


def test_a_fresh_start_with_ckpt_path_last_gets_no_save_last_hint(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        caught = fit(tmp_path / "exact", exact=True, steps=3, ckpt_path="last")
    assert not _has(caught, SAVE_LAST_HINT)
    assert _has(caught, NO_LAST)  # Lightning's warning stays, without the hint: it is true, and tests expect it
    assert any("ckpt_path='last' found no checkpoint" in r.getMessage() for r in caplog.records)  # our line
    stock = fit(tmp_path / "stock", exact=False, steps=3, ckpt_path="last")  # the same process, no ExactResume
    assert _has(stock, SAVE_LAST_HINT)


def test_a_pytorch_lightning_trainer_is_refused_with_the_fix(tmp_path):
    pytorch_lightning = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.demos.boring_classes import BoringModel

    trainer = pytorch_lightning.Trainer(
        default_root_dir=tmp_path, max_steps=2, logger=False, enable_progress_bar=False, callbacks=[ExactResume()]
    )
    with pytest.raises(ConfigurationError, match=r"pytorch_lightning\.Trainer.*import lightning\.pytorch as pl"):
        trainer.fit(BoringModel())
    assert trainer.global_step == 0  # refused at setup, before any step
