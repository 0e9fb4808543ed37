"""Collecting packs (``cas.gc``): only unreferenced packs of the lineage go; everything else stays. Local and S3."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lightning_resume.cas import gc, live
from lightning_resume.cas.layout import BLOCKS
from lightning_resume.errors import RetentionWarning
from lightning_resume.format.atomic import owner_token
from lightning_resume.storage import files as storage
from tests.helpers.dedupe import state, write_checkpoint, write_pack

pytestmark = pytest.mark.timeout(120)

A, B = "a" * 32, "b" * 32


def _pack_path(directory: str, name: str) -> str:
    return storage.join(storage.join(directory, BLOCKS), f"{name}.safetensors")


def _packs(directory: str) -> set:
    return {e.name for e in storage.list_dir(storage.join(directory, BLOCKS))}


def _two_saves(directory: str) -> tuple:
    """Two checkpoints of lineage A, each with its own pack (the frozen weight differs between them)."""
    first, _ = write_checkpoint(storage.join(directory, "step=1.ckpt"), state(1, frozen=1), A)
    second, _ = write_checkpoint(storage.join(directory, "step=2.ckpt"), state(2, frozen=2), A)
    return first, second


def _collects_only_the_unreferenced_pack_of_its_lineage(directory: str) -> None:
    first, second = _two_saves(directory)
    orphan = write_pack(directory, A, {"00" * 16: b"x" * 16})  # a save killed before its checkpoint file
    other = write_pack(directory, B, {"11" * 16: b"y" * 16})  # another fresh run in the same directory
    assert gc.collect(directory, A) == [_pack_path(directory, orphan)]
    storage.remove(storage.join(directory, "step=1.ckpt"))  # retention removed the older checkpoint
    assert gc.collect(directory, A) == [_pack_path(directory, first)]
    assert _packs(directory) == {f"{second}.safetensors", f"{other}.safetensors"}
    assert gc.collect(directory, A) == []


def test_collect_removes_only_unreferenced_packs_of_its_lineage(tmp_path) -> None:
    _collects_only_the_unreferenced_pack_of_its_lineage(str(tmp_path))


def test_collect_on_s3(s3_bucket: str) -> None:
    _collects_only_the_unreferenced_pack_of_its_lineage(f"{s3_bucket}/run")


def test_collect_keeps_what_it_cannot_prove_is_its_pack(tmp_path) -> None:
    directory = str(tmp_path)
    blocks = tmp_path / BLOCKS
    orphan = write_pack(directory, A, {"00" * 16: b"x" * 16})
    renamed = f"xxh3-128-{'0' * 32}.safetensors"  # a pack of A under a name its keys do not give
    os.rename(blocks / f"{orphan}.safetensors", blocks / renamed)
    (blocks / "notes.safetensors").write_bytes(b"not a pack")
    (blocks / f"xxh3-128-{'1' * 32}.safetensors").write_bytes(b"\x00" * 64)  # a pack's name, not a pack
    target = write_pack(str(tmp_path / "elsewhere"), A, {"22" * 16: b"z" * 16})
    os.symlink(tmp_path / "elsewhere" / BLOCKS / f"{target}.safetensors", blocks / f"{target}.safetensors")
    before = _packs(directory)
    assert gc.collect(directory, A) == []
    assert _packs(directory) == before
    assert (tmp_path / "elsewhere" / BLOCKS / f"{target}.safetensors").exists()


def test_collect_keeps_pending_and_kept_packs(tmp_path) -> None:
    directory = str(tmp_path)
    pending = write_pack(directory, A, {"00" * 16: b"x" * 16})
    kept = write_pack(directory, A, {"01" * 16: b"w" * 16})
    live.hold([_pack_path(directory, pending)])  # a save in flight will reference it
    try:
        assert gc.collect(directory, A, keep={kept}) == []
    finally:
        live.release([_pack_path(directory, pending)])
    assert sorted(gc.collect(directory, A)) == sorted(_pack_path(directory, p) for p in (pending, kept))


def test_a_checkpoint_whose_refs_cannot_be_read_stops_the_collection(tmp_path) -> None:
    directory = str(tmp_path)
    _two_saves(directory)
    orphan = write_pack(directory, A, {"00" * 16: b"x" * 16})
    damaged = tmp_path / "step=3.ckpt"
    damaged.write_bytes((400).to_bytes(8, "little") + b"{" + b"x" * 500)  # a header that is not JSON
    with pytest.warns(RetentionWarning, match=r"step=3\.ckpt"):
        assert gc.collect(directory, A) == []
    assert f"{orphan}.safetensors" in _packs(directory)
    damaged.unlink()
    assert gc.collect(directory, A) == [_pack_path(directory, orphan)]


def test_remove_and_collect_deletes_the_checkpoint_then_its_lineages_orphans(tmp_path) -> None:
    directory = str(tmp_path)
    first, second = _two_saves(directory)
    assert gc.remove_and_collect(str(tmp_path / "step=1.ckpt")) == [_pack_path(directory, first)]
    assert not (tmp_path / "step=1.ckpt").exists()
    assert _packs(directory) == {f"{second}.safetensors"}


def test_collect_removes_the_temporary_of_a_pack_write_killed_here(tmp_path) -> None:
    write_checkpoint(str(tmp_path / "step=1.ckpt"), state(1), A)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / BLOCKS / f".x.safetensors.tmp-{owner_token()}-{int(dead.stdout)}-0badf00d"
    stale.write_bytes(b"partial")
    gc.collect(str(tmp_path), A)
    assert not stale.exists()


def test_a_fifo_named_like_a_checkpoint_does_not_hang_the_collection(tmp_path) -> None:
    orphan = write_pack(str(tmp_path), A, {"00" * 16: b"x" * 16})
    os.mkfifo(tmp_path / "step=9.ckpt")
    assert gc.collect(str(tmp_path), A) == [_pack_path(str(tmp_path), orphan)]
