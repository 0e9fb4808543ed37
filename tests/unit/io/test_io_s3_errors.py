"""Errors on ``s3://`` (moto on 127.0.0.1) name the URL and what failed; a bucket without permission fails at once.

A missing, truncated or corrupt object is refused naming its URL and the problem. A bucket the credentials may
not use (the server answers 403 AccessDenied for it, as S3 does under a denying bucket policy: a middleware
in front of moto, which does not evaluate policies without its IAM emulation) or that does not exist fails the
first save at once, not retried, naming the URL; ``storage.check_writable`` finds it before any training
(a run's setup), for a prefix of a readable bucket too.
"""

from __future__ import annotations

import uuid
from typing import Iterator

import fsspec
import pytest
import torch

from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.format import write
from lightning_resume.format.read import read_summary
from lightning_resume.io.plugin import SafetensorsCheckpointIO
from lightning_resume.io.verify import verify
from lightning_resume.storage import files as storage
from lightning_resume.storage import multipart

pytestmark = pytest.mark.timeout(120)

DENIED = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"


def _state(step: int, numel: int = 1000) -> dict:
    return {"state_dict": {"w": torch.full((numel,), float(step))}, "global_step": step}


@pytest.fixture
def denied_prefix(s3_server, s3_bucket: str) -> Iterator[str]:
    """``s3://<bucket>/denied``: every request under it (and listings of it) answered 403, as a bucket policy
    denying the prefix to these credentials would."""
    wsgi = s3_server._server._server
    app, bucket = wsgi.app, s3_bucket[len("s3://") :]

    def deny(environ, start_response):
        path, query = environ.get("PATH_INFO", ""), environ.get("QUERY_STRING", "")
        if path.startswith(f"/{bucket}/denied") or (path.rstrip("/") == f"/{bucket}" and "prefix=denied" in query):
            start_response("403 Forbidden", [("Content-Type", "application/xml")])
            return [DENIED]
        return app(environ, start_response)

    wsgi.app = deny
    try:
        yield f"{s3_bucket}/denied"
    finally:
        wsgi.app = app


@pytest.fixture
def no_sleep(monkeypatch) -> list:
    slept: list = []
    monkeypatch.setattr(storage.time, "sleep", slept.append)
    return slept


def test_a_missing_object_is_named(s3_bucket: str) -> None:
    url = f"{s3_bucket}/run/step=9.ckpt"
    with pytest.raises(FileNotFoundError, match=f"{url}"):
        SafetensorsCheckpointIO().load_checkpoint(url)
    with pytest.raises(FileNotFoundError, match=f"{url}"):
        read_summary(url)


def test_a_truncated_object_is_refused_naming_the_url(s3_bucket: str) -> None:
    url = f"{s3_bucket}/run/step=1.ckpt"
    SafetensorsCheckpointIO().save_checkpoint(_state(1), url)
    fs, key = fsspec.core.url_to_fs(url)
    fs.pipe_file(key, fs.cat_file(key)[:-100])  # an upload cut short by something else than our commit
    with pytest.raises(CheckpointCorruptError, match="step=1.ckpt") as caught:
        SafetensorsCheckpointIO(fallback_to_verified=False).load_checkpoint(url)
    assert str(caught.value).startswith(url) and "truncated" in str(caught.value)
    with pytest.raises(CheckpointCorruptError, match="step=1.ckpt"):
        verify(url)


def test_an_object_that_is_not_a_checkpoint_is_refused_naming_the_url(s3_bucket: str) -> None:
    url = f"{s3_bucket}/run/step=2.ckpt"
    fsspec.filesystem("s3").pipe_file(url[len("s3://") :], b"<html>not found</html>" * 10)
    with pytest.raises(CheckpointCorruptError, match="step=2.ckpt.*not a checkpoint"):
        SafetensorsCheckpointIO().load_checkpoint(url)


def test_a_denied_prefix_fails_the_first_save_at_once_naming_the_url(denied_prefix: str, no_sleep: list) -> None:
    url = f"{denied_prefix}/step=1.ckpt"
    with pytest.raises(PermissionError, match=f"could not list {denied_prefix}: .*Access Denied.*not retried"):
        SafetensorsCheckpointIO().save_checkpoint(_state(1), url)  # its cleanup of stale uploads lists first
    with pytest.raises(PermissionError, match=f"could not upload {url}: .*Access Denied.*not retried"):
        write.save_file(_state(1), url)
    big = f"{denied_prefix}/step=2.ckpt"  # a multi-part upload is refused at its start
    with pytest.raises(PermissionError, match=f"could not begin the upload of {big}.*not retried"):
        write.save_file(_state(2, 3_000_000), big, upload=multipart.UploadOptions(5 << 20, 2))
    assert no_sleep == []


def test_check_writable_names_a_denied_prefix_or_a_missing_bucket_before_any_save(
    denied_prefix: str, no_sleep: list
) -> None:
    with pytest.raises(PermissionError, match=f"could not write checkpoints under {denied_prefix}"):
        storage.check_writable(denied_prefix)
    missing = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run"
    with pytest.raises(FileNotFoundError, match=f"could not write checkpoints under {missing}"):
        storage.check_writable(missing)
    assert no_sleep == []


def test_check_writable_leaves_nothing_behind_where_it_may_write(s3_bucket: str) -> None:
    storage.check_writable(f"{s3_bucket}/run")
    fs = fsspec.filesystem("s3")
    bucket = s3_bucket[len("s3://") :]
    assert fs.list_multipart_uploads(bucket) == [] and storage.list_dir(f"{s3_bucket}/run") == []
    memory = f"memory://writable-{uuid.uuid4().hex[:8]}/run"
    storage.check_writable(memory)
    assert storage.list_dir(memory) == []


def test_a_retention_run_on_a_denied_prefix_fails_at_setup_before_any_step(denied_prefix: str, no_sleep: list) -> None:
    """``RetentionCheckpoint`` checks its remote ``dirpath`` when the fit starts: no step is trained, the URL named."""
    from lightning_resume import RetentionCheckpoint, RetentionPolicy
    from tests.helpers.models import TinyModel, tiny_trainer

    model = TinyModel()
    trainer = tiny_trainer(
        [RetentionCheckpoint(dirpath=denied_prefix, retention=RetentionPolicy(keep_last=2))], max_steps=4
    )
    with pytest.raises(PermissionError, match=f"could not write checkpoints under {denied_prefix}"):
        trainer.fit(model)
    assert trainer.global_step == 0 and no_sleep == []
