"""A committed sharded directory whose ``.metadata`` points DCP's reader anywhere is refused before any read.

Each test builds the attack: a real checkpoint, its ``.metadata`` rewritten (storage references or
tensor sizes) and the marker re-committed over it (digests prove integrity, not origin). Every path
that reads a sharded directory (``load_full``, ``load_sharded``, ``verify_sharded``, the CLI) must
refuse it with ``CheckpointCorruptError`` naming the metadata file.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import threading
import zipfile

import pytest
import torch

from lightning_resume import load_full, load_sharded, save_sharded, verify_sharded
from lightning_resume.cli.main import main
from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.sharded.commit import commit
from lightning_resume.sharded.marker import CommitRecord, digest_files
from lightning_resume.sharded.safe_pickle import load_metadata

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state(scale: float = 1.0) -> dict:
    return {"model": {"w": torch.arange(6.0).reshape(2, 3) * scale}, "opt": {"lr": 0.1}}


def _template() -> dict:
    return {"model": {"w": torch.zeros(2, 3)}, "opt": {"lr": 0.0}}


def _rewrite(directory: str, change, extra_names=()) -> None:
    """Apply ``change`` to the metadata, write it back, and re-commit every file (as an attacker can)."""
    path = os.path.join(directory, ".metadata")
    metadata = load_metadata(path)
    change(metadata)
    with open(path, "wb") as handle:
        handle.write(pickle.dumps(metadata))
    names = [n for n in os.listdir(directory) if n != "COMMITTED" and os.path.isfile(os.path.join(directory, n))]
    commit(CommitRecord(directory, 1, 1, digest_files(directory, [*names, *extra_names])))


def _point(fqn: str, **changes):
    """A metadata change: the storage reference of ``fqn`` gets ``changes`` (relative_path, offset, length)."""

    def change(metadata) -> None:
        for index, info in list(metadata.storage_data.items()):
            if index.fqn == fqn:
                metadata.storage_data[index] = dataclasses.replace(info, **changes)

    return change


def _refused_everywhere(directory: str, match: str) -> None:
    with pytest.raises(CheckpointCorruptError, match=match):
        verify_sharded(directory)
    with pytest.raises(CheckpointCorruptError, match=match):
        load_full(directory)
    with pytest.raises(CheckpointCorruptError, match=match):
        load_sharded(_template(), directory)


def test_reference_to_another_directory_is_refused_not_read(tmp_path):
    other = save_sharded(_state(scale=100.0), str(tmp_path / "other"), step=1)
    directory = save_sharded(_state(), str(tmp_path / "ck"), step=1)
    shard = sorted(n for n in os.listdir(other) if n.endswith(".distcp"))[0]
    for path in (f"../other/{shard}", os.path.join(other, shard)):
        _rewrite(directory, _point("model.w", relative_path=path))
        _refused_everywhere(directory, "not a shard file listed in the commit marker")


def test_reference_to_dev_zero_with_a_huge_length_is_refused(tmp_path):
    directory = save_sharded(_state(), str(tmp_path / "ck"), step=1)
    _rewrite(directory, _point("model.w", relative_path="/dev/zero", length=1 << 30))
    _refused_everywhere(directory, "not a shard file listed")


def test_listed_symlink_out_of_the_directory_is_refused(tmp_path):
    other = save_sharded(_state(scale=100.0), str(tmp_path / "other"), step=1)
    directory = save_sharded(_state(), str(tmp_path / "ck"), step=1)
    shard = sorted(n for n in os.listdir(other) if n.endswith(".distcp"))[0]
    os.symlink(os.path.join(other, shard), os.path.join(directory, "link.distcp"))
    _rewrite(directory, _point("model.w", relative_path="link.distcp"), extra_names=["link.distcp"])
    _refused_everywhere(directory, "not a regular file")


def test_reference_to_a_fifo_is_refused_instead_of_blocking(tmp_path):
    directory = save_sharded(_state(), str(tmp_path / "ck"), step=1)
    fifo = os.path.join(directory, "pipe.distcp")
    os.mkfifo(fifo)
    _rewrite(directory, _point("model.w", relative_path="pipe.distcp"))
    outcome: list = []

    def load() -> None:
        try:
            load_full(directory)
            outcome.append("loaded")
        except Exception as err:  # the outcome is asserted below
            outcome.append(err)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(30)
    if thread.is_alive():  # unblock the reader so the test process can finish, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("load_full blocked on a FIFO named by the metadata")
    assert isinstance(outcome[0], CheckpointCorruptError) and "not a shard file listed" in str(outcome[0])


def test_reference_past_the_end_of_a_listed_file_is_refused(tmp_path):
    directory = save_sharded(_state(), str(tmp_path / "ck"), step=1)
    _rewrite(directory, _point("model.w", length=1 << 30))
    _refused_everywhere(directory, "runs past the end")


def test_two_references_to_the_same_bytes_are_refused(tmp_path):
    directory = save_sharded(_state(), str(tmp_path / "ck"), step=1)
    metadata = load_metadata(os.path.join(directory, ".metadata"))
    w = next(info for index, info in metadata.storage_data.items() if index.fqn == "model.w")
    _rewrite(directory, _point("opt.lr", offset=w.offset, length=w.length))
    _refused_everywhere(directory, "overlap")


def test_tensor_size_larger_than_its_chunks_is_refused_not_allocated(tmp_path):
    # the size lie: 6 stored floats declared as a 2000 x 3000 tensor (consolidate would write 24 MB of it)
    directory = save_sharded(_state(), str(tmp_path / "ck"), step=1)

    def lie(metadata) -> None:
        entry = metadata.state_dict_metadata["model.w"]
        metadata.state_dict_metadata["model.w"] = dataclasses.replace(entry, size=torch.Size([2000, 3000]))

    _rewrite(directory, lie)
    with pytest.raises(CheckpointCorruptError, match="do not tile its size"):
        verify_sharded(directory)
    with pytest.raises(CheckpointCorruptError, match="do not tile its size"):
        load_full(directory)
    out = tmp_path / "full.safetensors"
    assert main(["consolidate", directory, str(out)]) == 1
    assert not out.exists()


def test_chunk_larger_than_its_stored_bytes_is_refused(tmp_path):
    directory = save_sharded(_state(), str(tmp_path / "ck"), step=1)

    def grow(metadata) -> None:
        entry = metadata.state_dict_metadata["model.w"]
        chunk = dataclasses.replace(entry.chunks[0], sizes=torch.Size([2000, 3000]))
        metadata.state_dict_metadata["model.w"] = dataclasses.replace(
            entry, size=torch.Size([2000, 3000]), chunks=[chunk]
        )

    _rewrite(directory, grow)
    _refused_everywhere(directory, "larger than its stored bytes")


def test_real_checkpoints_still_verify_and_load(tmp_path):
    directory = save_sharded(_state(), str(tmp_path / "ck"), step=1)
    verify_sharded(directory)
    assert torch.equal(load_full(directory)["model"]["w"], _state()["model"]["w"])


def _replace_value(directory: str, fqn: str, payload: bytes) -> None:
    """Append ``payload`` to the shard holding ``fqn`` and point the value's storage at it."""
    metadata = load_metadata(os.path.join(directory, ".metadata"))
    info = next(info for index, info in metadata.storage_data.items() if index.fqn == fqn)
    shard = os.path.join(directory, info.relative_path)
    offset = os.path.getsize(shard)
    with open(shard, "ab") as handle:
        handle.write(payload)
    _rewrite(directory, _point(fqn, offset=offset, length=len(payload)))


def _rezipped(value, deflate, data_pkl: bytes | None = None) -> bytes:
    """``torch.save(value)``'s zip with the records whose name ``deflate`` picks deflated (torch stores them
    plain) and, with ``data_pkl``, its pickle replaced."""
    plain = io.BytesIO()
    torch.save(value, plain)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(plain.getvalue())) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = data_pkl if data_pkl is not None and info.filename.endswith("data.pkl") else src.read(info)
            if deflate(info.filename):
                dst.writestr(info.filename, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=1)
            else:
                dst.writestr(info, data)
    return out.getvalue()


def test_value_stored_as_a_deflate_bomb_is_refused_before_it_is_inflated(tmp_path):
    directory = save_sharded(_state(), str(tmp_path / "ck"), step=1)
    bomb = pickle.dumps("a" * (64 << 20), protocol=2)  # 64 MiB of one letter: deflates to a tiny record
    _replace_value(directory, "opt.lr", _rezipped(0.1, lambda name: name.endswith("data.pkl"), data_pkl=bomb))
    with pytest.raises(CheckpointCorruptError, match="compressed"):
        load_full(directory)


def test_value_stored_as_a_pickle_memo_dag_is_refused(tmp_path):
    directory = save_sharded(_state(), str(tmp_path / "ck"), step=1)
    leaf: list = []
    for _ in range(60):
        leaf = [leaf, leaf]
    payload = io.BytesIO()
    torch.save(leaf, payload)
    _replace_value(directory, "opt.lr", payload.getvalue())
    with pytest.raises(CheckpointCorruptError, match="MAX_TREE_NODES"):
        load_full(directory)


def test_tensor_chunk_with_a_deflated_record_is_refused_by_verify_and_load(tmp_path):
    directory = save_sharded(_state(), str(tmp_path / "ck"), step=1)
    _replace_value(directory, "model.w", _rezipped(torch.arange(6.0).reshape(2, 3), lambda name: True))
    _refused_everywhere(directory, "is compressed")
