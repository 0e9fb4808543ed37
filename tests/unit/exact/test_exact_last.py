"""``ckpt_path="last"`` with ``ExactResume`` in the run: the newest checkpoint that verifies, of any checkpoint
callback, stock ``ModelCheckpoint()`` included (issue 23.2); one line says what was chosen, or that nothing was."""

from __future__ import annotations

import logging

import lightning
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_resume import ExactResume, ResumeReport
from tests.helpers.filesystem import listing
from tests.helpers.models import TinyData, TinyModel, tiny_trainer

pytestmark = pytest.mark.timeout(300)


def _fit(callbacks, ckpt_path=None, max_epochs=2):
    lightning.seed_everything(0, verbose=False)
    trainer = tiny_trainer(callbacks, max_epochs=max_epochs, limit_train_batches=4)
    trainer.fit(TinyModel(), datamodule=TinyData(), ckpt_path=ckpt_path)
    return trainer


def test_the_default_model_checkpoint_relaunch_resumes_from_its_newest_file(tmp_path, caplog):
    _fit([ExactResume(mtbf=None), ModelCheckpoint(dirpath=tmp_path)])
    assert listing(tmp_path) == ["epoch=1-step=8.ckpt"]  # epoch-end saves, no last.ckpt
    exact = ExactResume(mtbf=None)
    with caplog.at_level(logging.INFO):
        trainer = _fit([exact, ModelCheckpoint(dirpath=tmp_path)], ckpt_path="last", max_epochs=3)
    chosen = str(tmp_path / "epoch=1-step=8.ckpt")
    assert exact.resume_report.source == chosen and exact.resume_report.step == 8
    lines = [r.getMessage() for r in caplog.records if "ckpt_path='last'" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"ckpt_path='last' resumes from {chosen}"), lines
    assert trainer.global_step == 12


def test_a_relaunch_that_finds_nothing_says_so_and_starts_fresh(tmp_path, caplog):
    exact = ExactResume(mtbf=None)
    with caplog.at_level(logging.INFO):
        trainer = _fit([exact, ModelCheckpoint(dirpath=tmp_path / "empty")], ckpt_path="last", max_epochs=1)
    lines = [r.getMessage() for r in caplog.records if "found no checkpoint" in r.getMessage()]
    assert len(lines) == 1 and str(tmp_path / "empty") in lines[0], lines
    assert exact.resume_report == ResumeReport() and trainer.global_step == 4


def test_a_corrupt_newest_file_is_skipped_naming_it(tmp_path):
    _fit([ExactResume(mtbf=None), ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)])
    newest = tmp_path / "epoch=1-step=8.ckpt"
    newest.write_bytes(newest.read_bytes()[:-64])  # truncated: the zip's records no longer check out
    exact = ExactResume(mtbf=None)
    with pytest.warns(UserWarning, match="skipping checkpoint .*epoch=1-step=8.ckpt"):
        _fit([exact, ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)], ckpt_path="last", max_epochs=3)
    assert exact.resume_report.source == str(tmp_path / "epoch=0-step=4.ckpt")


def test_without_exact_resume_last_keeps_lightnings_rule(tmp_path):
    _fit([ModelCheckpoint(dirpath=tmp_path)])
    with pytest.warns(UserWarning, match="no last checkpoint available"):
        trainer = _fit([ModelCheckpoint(dirpath=tmp_path)], ckpt_path="last", max_epochs=1)
    assert trainer.global_step == 4  # Lightning's drop-in behaviour: no last*.ckpt, a fresh start
