"""Retention paths on ``s3://`` (moto server on 127.0.0.1): names, listings and "last" keep the URL scheme."""

from __future__ import annotations

import fsspec
import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_resume import RetentionCheckpoint, RetentionPolicy, SafetensorsCheckpointIO
from lightning_resume._compat import lightning as lc
from lightning_resume.io.resolve import candidates

pytestmark = pytest.mark.timeout(120)


def test_rolling_names_keep_the_scheme() -> None:
    callback = RetentionCheckpoint(dirpath="s3://bucket/run/", retention=RetentionPolicy(keep_last=2))
    assert callback._rolling_path(5) == "s3://bucket/run/step=000000005.ckpt"


def test_listing_an_s3_dirpath_gives_urls_and_skips_temporaries(s3_bucket: str) -> None:
    fs = fsspec.filesystem("s3")
    base = s3_bucket[len("s3://") :]
    for name in ("step=000000003.ckpt", "step=000000006.ckpt", ".step=000000009.ckpt.tmp-0123456789ab-1-0badf00d"):
        fs.pipe_file(f"{base}/run/{name}", b"x")
    paths = sorted(e.path for e in candidates(f"{s3_bucket}/run", (".ckpt",)))
    assert paths == [f"{s3_bucket}/run/step=000000003.ckpt", f"{s3_bucket}/run/step=000000006.ckpt"]
    assert candidates(f"{s3_bucket}/nothing-here") == []


def test_stock_model_checkpoint_finds_last_on_s3_with_its_scheme(s3_bucket: str) -> None:
    fs = fsspec.filesystem("s3")
    base = s3_bucket[len("s3://") :]
    for name in ("last.ckpt", "last-v1.ckpt", "step=1.ckpt"):
        fs.pipe_file(f"{base}/run/{name}", b"x")
    SafetensorsCheckpointIO()  # installs the scheme-keeping "last" search
    callback = ModelCheckpoint(dirpath=f"{s3_bucket}/run", save_last=True)
    trainer = pl.Trainer(callbacks=[callback], logger=False, enable_progress_bar=False, enable_model_summary=False)
    found = callback._find_last_checkpoints(trainer)
    assert found == {f"{s3_bucket}/run/last.ckpt", f"{s3_bucket}/run/last-v1.ckpt"}
    assert lc._LIGHTNING_FIND_LAST(callback, trainer) != found  # Lightning's own drops the scheme


def test_superseded_exact_resume_snapshots_on_s3_are_found_by_url(s3_bucket: str) -> None:
    from lightning_resume.exact.snapshots import SNAPSHOT_PREFIX, older_snapshots

    fs = fsspec.filesystem("s3")
    base = s3_bucket[len("s3://") :]
    for step in (3, 6, 9):
        fs.pipe_file(f"{base}/run/{SNAPSHOT_PREFIX}{step:09d}.ckpt", b"x")
    found = sorted(older_snapshots(f"{s3_bucket}/run", 9))
    assert found == [f"{s3_bucket}/run/{SNAPSHOT_PREFIX}{s:09d}.ckpt" for s in (3, 6)]


def test_a_fit_on_s3_rides_out_server_errors_and_prunes_and_resumes_last(
    s3_bucket: str, s3_server, monkeypatch
) -> None:
    """HTTP 500s during the run: every save retries and lands; keep_last=2 prunes on S3; "last" resolves there."""
    from lightning_resume.storage import files as storage
    from tests.helpers.models import tiny_fit

    monkeypatch.setattr(storage, "RETRY_BASE_S", 0.01)
    dirpath = f"{s3_bucket}/fit"
    s3_server.faults.fail(8)  # the first uploads fail, past the client's own retries
    callback = RetentionCheckpoint(dirpath=dirpath, retention=RetentionPolicy(keep_last=2), every_n_train_steps=2)
    trainer = tiny_fit(callback, plugins=[SafetensorsCheckpointIO(save="async")])
    assert s3_server.faults.seen == 8 and trainer.global_step == 12
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(dirpath[len("s3://") :]))
    assert names == ["step=000000010.ckpt", "step=000000012.ckpt"]
    again = RetentionCheckpoint(dirpath=dirpath, retention=RetentionPolicy(keep_last=2), every_n_train_steps=2)
    resumed = tiny_fit(again, ckpt_path="last", plugins=[SafetensorsCheckpointIO()], max_epochs=4)
    assert resumed.ckpt_path == f"{dirpath}/step=000000012.ckpt" and resumed.global_step == 16
