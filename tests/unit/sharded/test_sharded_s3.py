"""Sharded checkpoints on ``s3://`` in one process (moto server on 127.0.0.1): the versioned layout and its
commit, a re-save seen whole old or whole new, cleanup by owner and age, corrupt and hostile objects refused
naming them, deletion marker first, and "last" across files and sharded directories.

Multi-process runs (2 gloo ranks saving, 3 loading; SIGKILL; Lightning): tests/integration/test_sharded_s3.py.
"""

from __future__ import annotations

import json
import os
import pickle
import time
import warnings

import fsspec
import pytest
import torch

from lightning_resume.errors import CheckpointCorruptError, ShardedSaveError, UnsafeCheckpointError
from lightning_resume.format import atomic
from lightning_resume.io.plugin import SafetensorsCheckpointIO
from lightning_resume.io.resolve import candidates, newest_committed, newest_verified
from lightning_resume.io.sharded_strategy import ShardedCheckpointIO
from lightning_resume.sharded import commit as commits
from lightning_resume.sharded import marker
from lightning_resume.sharded.api import (
    clean_uncommitted,
    load_full,
    load_meta,
    load_sharded,
    save_sharded,
    verify_sharded,
)
from lightning_resume.sharded.background import save_sharded_async
from lightning_resume.sharded.marker import DATA, DCP_METADATA, MARKER, read_marker
from lightning_resume.storage import files as storage

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]


def state(value: float) -> dict:
    return {"model": {"w": torch.full((16, 8), value), "b": torch.arange(5) + int(value)}, "step": int(value)}


def fs_key(url: str) -> str:
    return url[len("s3://") :]


def objects(url: str) -> list:
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    base = fs_key(url).rstrip("/") + "/"
    return sorted(k[len(base) :] for k in fs.find(base))


def put(url: str, data: bytes) -> None:
    fs = fsspec.filesystem("s3")
    fs.pipe_file(fs_key(url), data)
    fs.invalidate_cache()


def get(url: str) -> bytes:
    return bytes(fsspec.filesystem("s3").cat_file(fs_key(url)))


def loaded(directory: str) -> dict:
    template = state(0.0)
    load_sharded(template, directory)
    return template


def test_save_load_verify_on_s3_keep_every_file_in_the_one_version_the_marker_names(s3_bucket, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    final = f"{s3_bucket}/run/step-1"
    assert save_sharded(state(1.0), final, 1, meta={"global_step": 1}) == final
    names = objects(final)
    record = verify_sharded(final)
    assert DATA.match(record.data) and record.location == f"{final}/{record.data}"
    assert names == sorted([MARKER, *(f"{record.data}/{n}" for n in record.files)])
    assert set(record.files) == {DCP_METADATA, "__0_0.distcp", "meta.safetensors"}
    body = json.loads(get(f"{final}/{MARKER}"))
    assert body["format"] == marker.VERSIONED_FORMAT and body["data"] == record.data
    got = loaded(final)
    assert torch.equal(got["model"]["w"], state(1.0)["model"]["w"]) and got["step"] == 1
    assert load_meta(final, record) == {"global_step": 1} == load_meta(final)
    assert torch.equal(load_full(final)["model"]["b"], state(1.0)["model"]["b"])
    assert list(tmp_path.iterdir()) == []  # no local folder named "s3:"


def test_a_resave_under_the_same_name_is_seen_whole_old_or_whole_new(s3_bucket, monkeypatch):
    final = f"{s3_bucket}/run/last"
    save_sharded(state(1.0), final, 1)
    old = verify_sharded(final)

    def fail_before_the_marker(record):
        raise OSError(5, "killed before the marker PUT (injected)")

    with monkeypatch.context() as patch:
        patch.setattr(commits, "commit", fail_before_the_marker)
        with pytest.raises(ShardedSaveError, match="failed to commit"):
            save_sharded(state(2.0), final, 2)
    assert verify_sharded(final) == old and loaded(final)["step"] == 1  # the old one, whole
    assert {n.split("/")[0] for n in objects(final)} == {MARKER, old.data}  # the failed version was discarded

    save_sharded(state(3.0), final, 3)
    new = verify_sharded(final)
    assert new.data != old.data and new.step == 3
    assert torch.equal(loaded(final)["model"]["w"], state(3.0)["model"]["w"])
    assert {n.split("/")[0] for n in objects(final)} == {MARKER, new.data}  # the replaced version is gone
    assert storage.file_sizes(old.location) == {}  # a reader holding the old record finds nothing, never new files


def test_cleanup_removes_unnamed_versions_by_owner_and_age_never_the_named_one(s3_bucket):
    root = f"{s3_bucket}/run"
    final = f"{root}/step-1"
    save_sharded(state(1.0), final, 1)
    record = verify_sharded(final)
    mine = atomic.owner_token()
    dead_named = f".v-{mine}-999999998-0badf00d"  # the committed version, under a dead pid: still kept
    fs = fsspec.filesystem("s3")
    fs.copy(fs_key(record.location), fs_key(f"{final}/{dead_named}"), recursive=True)
    body = json.loads(get(f"{final}/{MARKER}"))
    put(f"{final}/{MARKER}", json.dumps(dict(body, data=dead_named)).encode())
    fs.rm(fs_key(record.location), recursive=True)
    dead = f".v-{mine}-999999999-0badf00d"
    live = f".v-{mine}-{os.getpid()}-0badf00d"
    foreign = ".v-0123456789ab-5-0badf00d"
    for version in (dead, live, foreign):
        put(f"{final}/{version}/__0_0.distcp", b"x")
    put(f"{root}/fresh/{dead}/__0_0.distcp", b"x")  # a first save that never committed
    put(f"{root}/fresh/user-file", b"x")  # not ours: never removed

    removed = clean_uncommitted(root)
    assert sorted(removed) == sorted([f"{final}/{dead}", f"{root}/fresh/{dead}"])
    later = commits.clean_uncommitted(root, now=time.time() + 2 * atomic.STALE_AFTER_S)
    assert later == [f"{final}/{foreign}"]
    assert {n.split("/")[0] for n in objects(final)} == {MARKER, dead_named, live}
    assert objects(f"{root}/fresh") == ["user-file"]
    assert verify_sharded(final).data == dead_named and loaded(final)["step"] == 1


def test_corrupt_truncated_and_missing_objects_are_refused_naming_them(s3_bucket):
    root = f"{s3_bucket}/run"
    save_sharded(state(1.0), f"{root}/step-1", 1)
    save_sharded(state(2.0), f"{root}/step-2", 2)
    record = verify_sharded(f"{root}/step-2")
    shard = f"{record.location}/__0_0.distcp"
    data = bytearray(get(shard))
    data[len(data) // 2] ^= 0x01
    put(shard, bytes(data))
    with pytest.raises(CheckpointCorruptError, match=f"{shard}.*SHA-256 differs"):
        verify_sharded(f"{root}/step-2")
    verify_sharded(f"{root}/step-2", digests=False)  # same size: only the digest tells
    with pytest.raises(CheckpointCorruptError):
        loaded(f"{root}/step-2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert newest_committed(root) == f"{root}/step-1"
    assert any(f"{root}/step-2" in str(w.message) and "SHA-256" in str(w.message) for w in caught)

    put(shard, bytes(data[:-10]))
    with pytest.raises(CheckpointCorruptError, match=f"{shard}.*size differs"):
        verify_sharded(f"{root}/step-2", digests=False)
    fsspec.filesystem("s3").rm(fs_key(shard))
    with pytest.raises(CheckpointCorruptError, match=f"{shard}.*missing"):
        verify_sharded(f"{root}/step-2", digests=False)


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/lightning-resume-pwned-s3",))


@pytest.mark.parametrize(
    "edit",
    ["data-escapes", "data-nested", "file-name-with-slash", "unknown-format", "oversized-marker", "pickle-payload"],
)
def test_hostile_markers_and_metadata_on_s3_are_refused_before_anything_loads(s3_bucket, monkeypatch, edit):
    final = f"{s3_bucket}/run/step-1"
    save_sharded(state(1.0), final, 1)
    record = verify_sharded(final)
    body = json.loads(get(f"{final}/{MARKER}"))
    expected: type = CheckpointCorruptError
    if edit == "data-escapes":
        body["data"], match = "../other", "invalid data prefix"
    elif edit == "data-nested":
        body["data"], match = f"{record.data}/x", "invalid data prefix"
    elif edit == "file-name-with-slash":
        body["files"]["../x"], match = body["files"][DCP_METADATA], "invalid file name"
    elif edit == "unknown-format":
        body["format"], match = "lightning-resume/sharded/9", "unknown commit marker format"
    elif edit == "oversized-marker":
        monkeypatch.setattr(marker, "MAX_MARKER_BYTES", 64)
        match = "larger than MAX_MARKER_BYTES"
    else:
        hostile = pickle.dumps(_Payload())
        put(f"{record.location}/{DCP_METADATA}", hostile)
        body["files"][DCP_METADATA] = {
            "size": len(hostile),
            "sha256": marker.digest_file(f"{record.location}/{DCP_METADATA}").sha256,
        }
        expected, match = UnsafeCheckpointError, "os.system|posix.system"
    put(f"{final}/{MARKER}", json.dumps(body).encode())
    with pytest.raises(expected, match=match):
        verify_sharded(final)
    with pytest.raises((CheckpointCorruptError, UnsafeCheckpointError)):
        loaded(final)
    assert not os.path.exists("/tmp/lightning-resume-pwned-s3")


def test_removing_a_sharded_checkpoint_on_s3_deletes_its_marker_first(s3_bucket, monkeypatch):
    final = f"{s3_bucket}/run/step=2.ckpt"
    save_sharded(state(2.0), final, 2)
    calls = []
    remove = storage.remove
    monkeypatch.setattr(storage, "remove", lambda path: (calls.append(path), remove(path))[1])
    ShardedCheckpointIO().remove_checkpoint(final)
    assert calls[0] == f"{final}/{MARKER}"  # from the first deletion on, nothing is committed there
    assert objects(f"{s3_bucket}/run") == []


def test_last_across_files_and_sharded_directories_on_s3_is_the_newest_that_verifies(s3_bucket):
    root = f"{s3_bucket}/run"
    SafetensorsCheckpointIO().save_checkpoint(
        {"state_dict": {"w": torch.ones(3)}, "global_step": 2}, f"{root}/step=2.ckpt"
    )
    save_sharded(state(4.0), f"{root}/step=4.ckpt", 4)
    save_sharded(state(6.0), f"{root}/step=6.ckpt", 6)
    fsspec.filesystem("s3").rm(fs_key(f"{root}/step=6.ckpt/{MARKER}"))  # as if killed before its commit
    put(f"{root}/step=8.ckpt", b"\x00" * 64)  # a newer file, corrupt
    paths = [e.path for e in candidates(root)]
    assert sorted(storage.basename(p) for p in paths) == ["step=2.ckpt", "step=4.ckpt", "step=8.ckpt"]
    skipped: list = []
    assert newest_verified(paths, skipped=skipped.append) == f"{root}/step=4.ckpt"
    assert len(skipped) == 1 and "step=8.ckpt" in skipped[0]
    fsspec.filesystem("s3").rm(fs_key(f"{root}/step=4.ckpt/{MARKER}"))
    assert newest_verified([e.path for e in candidates(root)], skipped=skipped.append) == f"{root}/step=2.ckpt"


def test_an_async_sharded_save_to_s3_is_committed_at_wait(s3_bucket):
    final = f"{s3_bucket}/run/step-5"
    handle = save_sharded_async(state(5.0), final, 5, meta={"global_step": 5})
    assert handle.wait() and handle.committed
    record = read_marker(final)
    assert record.step == 5 and load_meta(final, record) == {"global_step": 5}
    assert torch.equal(loaded(final)["model"]["w"], state(5.0)["model"]["w"])


def test_last_is_handed_to_lightning_as_the_marker_object_which_it_can_time_and_maps_back(s3_bucket):
    """Lightning times every "last" candidate with ``fs.modified``, which a prefix lacks on S3."""
    root = f"{s3_bucket}/run"
    save_sharded(state(4.0), f"{root}/step=4.ckpt", 4)
    io = ShardedCheckpointIO()
    fs = fsspec.filesystem("s3")
    with pytest.raises(IsADirectoryError):
        fs.modified(fs_key(f"{root}/step=4.ckpt"))
    chosen = io.resolve_newest([e.path for e in candidates(root)], skipped=print)
    assert chosen == f"{root}/step=4.ckpt/{MARKER}" and fs.modified(fs_key(chosen))
    assert io.loaded_path(chosen) == f"{root}/step=4.ckpt"
    assert io.loaded_path(f"{root}/step=2.ckpt") == f"{root}/step=2.ckpt"


def test_a_tensor_larger_than_one_ranged_get_verifies_and_loads_bitwise(s3_bucket):
    """Items above ``safe_pickle._WHOLE_ITEM_BYTES`` are checked through ranged reads, up to their very end."""
    final = f"{s3_bucket}/run/big"
    big = {"w": torch.randn(3 << 18)}  # 3 MiB of float32: one shard item read in windows
    save_sharded(big, final, 1)
    record = verify_sharded(final)
    assert record.files["__0_0.distcp"].size > 3 << 20
    template = {"w": torch.empty(3 << 18)}
    load_sharded(template, final)
    assert torch.equal(template["w"], big["w"])
