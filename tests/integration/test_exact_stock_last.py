"""``fit(ckpt_path="last")`` with the default ``ModelCheckpoint()`` resumes, killed for real (issue 23.2).

Lightning's "last" is the newest ``last*.ckpt``, which the default ``ModelCheckpoint()`` (epoch-end saves, no
``save_last``) never writes: a relaunch silently trained from step 0. With ``ExactResume`` in the run, "last"
is the newest checkpoint of the run's checkpoint callbacks that verifies: here ``epoch=1-step=20.ckpt``. The
run is killed in its third epoch (``max_steps`` across epoch ends, a plain shuffled ``DataLoader``), resumed in
a fresh process, and compared with the uninterrupted one step by step, and file by file (the file resumed
from stays: Lightning's ``ModelCheckpoint`` never deletes the checkpoint a run resumed from).
"""

from __future__ import annotations

import pytest

from tests.helpers import kill_resume as h
from tests.helpers.filesystem import listing

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

DEFAULT_CHECKPOINT = {"ckpt": {}, "pipeline": "plain", "max_epochs": None, "max_steps": 25}  # 10 batches an epoch


def test_default_model_checkpoint_relaunch_resumes_from_the_newest_epoch_end_file(tmp_path):
    a, c = h.three_runs(DEFAULT_CHECKPOINT, tmp_path, pause=22)
    h.assert_exact_resume(a["out"], c["out"], resumed_after=20)
    said = h.output(c, tail=None)
    assert "ckpt_path='last' resumes from" in said and "epoch=1-step=20.ckpt" in said, said[-3000:]
    # the same files as the uninterrupted run, and the one resumed from, which Lightning never deletes
    assert listing(a["ckpt_dir"]) == ["epoch=2-step=25.ckpt"]
    assert listing(c["ckpt_dir"]) == ["epoch=1-step=20.ckpt", "epoch=2-step=25.ckpt"]
