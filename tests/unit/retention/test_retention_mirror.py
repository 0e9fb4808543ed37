"""``RetentionCheckpoint(mirror=Mirror(...))``: the uploader on its own, then real fits mirroring to ``s3://`` (moto on
127.0.0.1): per-tier retention, a bucket that always fails, sync anchors, "last" across tiers, arguments, YAML."""

from __future__ import annotations

import os
import threading
import time
import warnings
from pathlib import Path

import fsspec
import lightning.pytorch as lightning
import pytest
import yaml
from lightning.pytorch.callbacks import Callback

from lightning_resume import Mirror, RetentionCheckpoint, RetentionPolicy, SafetensorsCheckpointIO
from lightning_resume.errors import ConfigurationError, RetentionWarning
from lightning_resume.retention.mirror import MirrorUploader, UploadFailed, copy_file
from lightning_resume.retention.naming import rolling_name
from lightning_resume.retention.tiers import UploadRetry
from lightning_resume.storage import files as storage
from tests.helpers.models import TINY_TRAINER, TinyData, TinyModel, tiny_fit
from tests.helpers.paths import REPO_ROOT

pytestmark = pytest.mark.timeout(180)


def _names(url: str) -> list[str]:
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url[len("s3://") :])) if fs.exists(url) else []


def _local(directory: Path) -> list[str]:
    return sorted(os.listdir(directory)) if directory.exists() else []


# ------------------------------------------------------------------------------ the uploader alone


def test_an_upload_waits_for_its_local_write_then_lands(tmp_path: Path) -> None:
    source = tmp_path / "step=000000003.ckpt"
    source.write_bytes(b"x" * 1000)
    ready = threading.Event()
    mirror = MirrorUploader(str(tmp_path / "mirror"))
    assert mirror.upload(str(source), ready.is_set) == str(tmp_path / "mirror" / source.name)
    assert not mirror.wait(str(source), timeout=0.2)  # the local write is still running
    ready.set()
    assert mirror.wait(str(source), timeout=120)
    (outcome,) = mirror.settle()
    assert outcome.error is None and (tmp_path / "mirror" / source.name).read_bytes() == b"x" * 1000
    assert mirror.settle() == []  # handed out once


def test_a_failing_upload_is_named_and_queued_again_after_its_wait(tmp_path: Path) -> None:
    calls: list[str] = []

    def refuse(source: str, target: str) -> None:
        calls.append(target)
        raise PermissionError(13, "Access Denied")

    now = [100.0]
    mirror = MirrorUploader("s3://bucket/run", transfer=refuse, retry=UploadRetry(base_s=5.0), clock=lambda: now[0])
    source = str(tmp_path / "step=000000006.ckpt")
    Path(source).write_bytes(b"x")
    mirror.upload(source)
    assert mirror.wait(timeout=120)
    (outcome,) = mirror.settle()
    assert isinstance(outcome.error, UploadFailed) and outcome.failures == 1
    assert f"upload of {source} to s3://bucket/run/step=000000006.ckpt failed: PermissionError" in str(outcome.error)
    now[0] = 104.0
    assert mirror.retry_due() == []  # 5 s after the first failure, not before
    now[0] = 105.0
    assert mirror.retry_due() == [source]
    assert mirror.wait(timeout=120) and [o.failures for o in mirror.settle()] == [2]
    assert calls == ["s3://bucket/run/step=000000006.ckpt"] * 2


def test_a_deletion_runs_after_the_uploads_queued_before_it(tmp_path: Path) -> None:
    order: list[str] = []
    release = threading.Event()

    def slow(source: str, target: str) -> None:
        release.wait(10)
        order.append(f"upload {storage.basename(target)}")

    mirror = MirrorUploader(str(tmp_path / "m"), transfer=slow)
    Path(tmp_path / "a.ckpt").write_bytes(b"x")
    mirror.upload(str(tmp_path / "a.ckpt"))
    (tmp_path / "m").mkdir()
    old = tmp_path / "m" / "old.ckpt"
    old.write_bytes(b"x")
    mirror.remove(str(old))
    time.sleep(0.1)
    assert old.exists()  # the deletion waits for the upload ahead of it
    release.set()
    assert mirror.wait(timeout=120) and not old.exists() and order == ["upload a.ckpt"]


def test_copy_file_commits_whole_and_checks_the_size(tmp_path: Path) -> None:
    source = tmp_path / "a.ckpt"
    source.write_bytes(os.urandom(3 << 20))
    copy_file(str(source), str(tmp_path / "m" / "a.ckpt"))
    assert (tmp_path / "m" / "a.ckpt").read_bytes() == source.read_bytes()
    with pytest.raises(FileNotFoundError, match="nothing to upload"):
        copy_file(str(tmp_path / "gone.ckpt"), str(tmp_path / "m" / "gone.ckpt"))


# ------------------------------------------------------------------------------ fits mirroring to S3


def _mirrored(dirpath: Path, url: str, anchors: str = "async") -> RetentionCheckpoint:
    retention = RetentionPolicy(keep_last=3, anchor_every_n_steps=5)
    mirror = Mirror(url, local_keep_last=1, anchors=anchors)  # type: ignore[arg-type]
    return RetentionCheckpoint(dirpath=dirpath, every_n_train_steps=2, retention=retention, mirror=mirror)


def test_per_tier_retention_on_s3_through_server_errors(tmp_path: Path, s3_bucket: str, s3_server, monkeypatch):
    monkeypatch.setattr(storage, "RETRY_BASE_S", 0.01)
    s3_server.faults.fail(6)  # the first uploads fail, past the client's own retries: storage retries them
    callback = _mirrored(tmp_path / "ckpt", f"{s3_bucket}/run")
    trainer = tiny_fit(callback, plugins=[SafetensorsCheckpointIO(save="async")])
    assert trainer.global_step == 12 and s3_server.faults.seen == 6
    # bucket: the 3 most recent (8, 10, 12) and the anchors of [5, 10) and [10, 15): 6 and 10
    assert _names(f"{s3_bucket}/run") == [rolling_name(s) for s in (6, 8, 10, 12)]
    assert _local(tmp_path / "ckpt") == [rolling_name(12)]  # local: the newest only
    saved = callback.state_dict()["retention"]["mirror"]
    assert [r["path"] for r in saved] == [f"{s3_bucket}/run/{rolling_name(s)}" for s in (6, 8, 10, 12)]


def test_a_bucket_that_always_fails_leaves_training_running_with_a_named_warning(tmp_path: Path, s3_server):
    callback = _mirrored(tmp_path / "ckpt", "s3://no-such-bucket-lightning-resume/run")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = tiny_fit(callback, plugins=[SafetensorsCheckpointIO(save="async")])
    assert trainer.global_step == 12
    told = [str(w.message) for w in caught if issubclass(w.category, RetentionWarning)]
    first = f"mirror upload of {tmp_path / 'ckpt' / rolling_name(2)} to s3://no-such-bucket-lightning-resume/run/"
    assert any(m.startswith(f"RetentionCheckpoint: {first}") and "Training goes on" in m for m in told), told
    assert any("does not have step=000000002.ckpt" in m for m in told), told
    assert _local(tmp_path / "ckpt") == [rolling_name(s) for s in range(2, 13, 2)]  # nothing local deleted


class _AnchorsInBucket(Callback):
    """At each batch start, whether the newest save so far is in the bucket (the save ran at the end of
    the batch before)."""

    def __init__(self, url: str) -> None:
        self.url, self.seen = url, {}

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step in (5, 6):  # just after the save of step 4 and step 6 (the anchor of [5, 10))
            self.seen[trainer.global_step] = set(_names(self.url))


class _SlowPuts:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def wrap(self, app):
        def middleware(environ, start_response):
            if environ.get("REQUEST_METHOD") in ("PUT", "POST"):
                time.sleep(self.seconds)
            return app(environ, start_response)

        return middleware


@pytest.mark.parametrize("anchors", ["sync", "async"])
def test_sync_anchors_are_in_the_bucket_when_their_save_returns(tmp_path, s3_bucket, s3_server, anchors):
    wsgi = s3_server._server._server  # the werkzeug server under moto (as tests/helpers/s3.py)
    original, wsgi.app = wsgi.app, _SlowPuts(0.5).wrap(wsgi.app)
    try:
        url = f"{s3_bucket}/{anchors}"
        probe = _AnchorsInBucket(url)
        callback = _mirrored(tmp_path / "ckpt", url, anchors=anchors)
        lightning.seed_everything(0, verbose=False)
        trainer = lightning.Trainer(callbacks=[callback, probe], **{**TINY_TRAINER, "max_steps": 7})
        trainer.fit(TinyModel(), datamodule=TinyData())
    finally:
        wsgi.app = original
    assert rolling_name(4) not in probe.seen[5]  # a save that is not an anchor never waits for its upload
    assert (rolling_name(6) in probe.seen[6]) is (anchors == "sync")


def test_last_is_the_mirror_copy_when_the_local_one_is_damaged(tmp_path: Path, s3_bucket: str) -> None:
    tiny_fit(_mirrored(tmp_path / "ckpt", f"{s3_bucket}/run"), plugins=[SafetensorsCheckpointIO()])
    newest = tmp_path / "ckpt" / rolling_name(12)
    newest.write_bytes(newest.read_bytes()[:100])  # truncated on the local disk
    again = _mirrored(tmp_path / "ckpt", f"{s3_bucket}/run")
    with pytest.warns(Warning, match=f"skipping checkpoint {newest}"):
        resumed = tiny_fit(again, ckpt_path="last", plugins=[SafetensorsCheckpointIO()], max_epochs=4)
    assert resumed.ckpt_path == f"{s3_bucket}/run/{rolling_name(12)}" and resumed.global_step == 16


def test_a_new_node_resumes_from_the_bucket(tmp_path: Path, s3_bucket: str) -> None:
    tiny_fit(_mirrored(tmp_path / "ckpt", f"{s3_bucket}/run"), plugins=[SafetensorsCheckpointIO()])
    for name in _local(tmp_path / "ckpt"):
        os.remove(tmp_path / "ckpt" / name)
    again = _mirrored(tmp_path / "ckpt", f"{s3_bucket}/run")
    resumed = tiny_fit(again, ckpt_path="last", plugins=[SafetensorsCheckpointIO()], max_epochs=4)
    assert resumed.ckpt_path == f"{s3_bucket}/run/{rolling_name(12)}" and resumed.global_step == 16
    # the earlier run's uploads are this run's too (resumed): pruned by the same rules
    assert _names(f"{s3_bucket}/run") == [rolling_name(s) for s in (6, 10, 12, 14, 16)]
    assert _local(tmp_path / "ckpt") == [rolling_name(16)]


def test_bad_mirror_arguments_name_the_argument_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError) as info:
        Mirror(" ", local_keep_last=0, anchors="x")  # type: ignore[arg-type]
    problems = " | ".join(info.value.problems)
    for needle in ("mirror.url=' ' is not a location", "mirror.local_keep_last=0 would delete", "mirror.anchors='x'"):
        assert needle in problems, problems
    with pytest.raises(ConfigurationError) as info:
        RetentionCheckpoint(dirpath=tmp_path, mirror=Mirror(str(tmp_path), anchors="sync"))
    problems = " | ".join(info.value.problems)
    for needle in (
        "is dirpath itself; use another location",
        "needs a retention rule to apply per tier; set retention.keep_last",
        "no anchor rule is set; set retention.anchor_every_n_steps",
    ):
        assert needle in problems, problems
    with pytest.raises(ConfigurationError, match="mirror='s3://b/run' is not a Mirror; use mirror=Mirror"):
        RetentionCheckpoint(retention=RetentionPolicy(keep_last=2), mirror="s3://b/run")  # type: ignore[arg-type]


def test_lightning_cli_runs_the_shipped_mirror_config(tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI

    config = yaml.safe_load((REPO_ROOT / "configs" / "retention_mirror.yaml").read_text())
    init = config["trainer"]["callbacks"][0]["init_args"]
    assert init["mirror"]["url"].startswith("s3://") and init["mirror"]["anchors"] == "sync"
    init.update(dirpath=str(tmp_path / "local"), every_n_train_steps=2, monitor=None)
    init["mirror"]["url"] = str(tmp_path / "bucket")
    init["retention"].update(anchor_every_n_steps=4, keep_best=None)
    config["trainer"].update(TINY_TRAINER, max_steps=10)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    lightning.seed_everything(0, verbose=False)
    LightningCLI(TinyModel, TinyData, args=["fit", "--config", str(path)], save_config_callback=None)
    assert _local(tmp_path / "local") == [rolling_name(8), rolling_name(10)]  # local_keep_last: 2
    assert _local(tmp_path / "bucket") == [rolling_name(s) for s in (4, 6, 8, 10)]
