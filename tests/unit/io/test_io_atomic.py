"""Atomic commit in one process: a failed write keeps the old file, stale temporaries of dead writers
are cleaned, fsspec filesystems work. SIGKILL at random moments of a save: tests/integration/test_io_atomic_sigkill.py."""

from __future__ import annotations

import os

import fsspec
import pytest
import torch

from lightning_resume import SafetensorsCheckpointIO
from lightning_resume.format.atomic import STALE_AFTER_S, atomic_write, clean_stale_temporaries, owner_token, temp_name


def test_failed_write_keeps_old_file_and_leaves_no_temporary(tmp_path):
    path = str(tmp_path / "a.bin")
    atomic_write(path, lambda f: f.write(b"old"))

    def broken(f):
        f.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, broken)
    assert open(path, "rb").read() == b"old"
    assert os.listdir(tmp_path) == ["a.bin"]


def test_stale_cleanup_only_touches_dead_writers_temporaries(tmp_path):
    dead = tmp_path / f".x.ckpt.tmp-{owner_token()}-999999999-0123abcd"  # this host, no such process
    elsewhere = tmp_path / f".x.ckpt.tmp-{'0' * 12}-999999999-0123abcd"  # another host: the pid proves nothing
    live = tmp_path / temp_name("y.ckpt")  # our own pid: a save in flight
    other = tmp_path / ".x.ckpt.tmp-notours"
    unowned = tmp_path / ".x.ckpt.tmp-999999999-0123abcd"  # names no owner: no save of ours, never touched
    for p in (dead, elsewhere, live, other, unowned):
        p.write_bytes(b"")
    assert clean_stale_temporaries(str(tmp_path)) == [str(dead)]
    assert sorted(os.listdir(tmp_path)) == sorted([elsewhere.name, live.name, other.name, unowned.name])
    later = os.stat(elsewhere).st_mtime + STALE_AFTER_S + 1
    assert clean_stale_temporaries(str(tmp_path), now=later) == [str(elsewhere)]


def test_memory_filesystem_save_load_and_no_leftovers():
    io = SafetensorsCheckpointIO()
    ck = {"global_step": 2, "state_dict": {"w": torch.randn(3)}}
    io.save_checkpoint(ck, "memory://ckpts/last.ckpt")
    io.verify_checkpoint("memory://ckpts/last.ckpt")
    assert torch.equal(io.load_checkpoint("memory://ckpts/last.ckpt")["state_dict"]["w"], ck["state_dict"]["w"])
    fs = fsspec.filesystem("memory")
    assert [os.path.basename(p) for p in fs.ls("/ckpts", detail=False)] == ["last.ckpt"]
    io.remove_checkpoint("memory://ckpts/last.ckpt")
    assert not fs.exists("/ckpts/last.ckpt")
