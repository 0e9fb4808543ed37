"""Atomic commit: SIGKILL at random moments of a save never leaves an unloadable "last" file."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time

import fsspec
import pytest
import torch

from lightning_resume.io import SafetensorsCheckpointIO
from lightning_resume.io.atomic import atomic_write, clean_stale_temporaries, temp_name
from lightning_resume.io.files import load_file

NUMEL = 5_000_000  # 20 MB of float32


def _save_forever(path: str, started, saved) -> None:
    torch.set_num_threads(1)
    io = SafetensorsCheckpointIO()
    w = torch.empty(NUMEL)
    step = saved.value
    started.set()
    while True:
        step += 1
        w.fill_(float(step))
        io.save_checkpoint({"global_step": step, "state_dict": {"w": w}}, path)
        with saved.get_lock():
            saved.value = step


def _temporaries(directory: str):
    return [n for n in os.listdir(directory) if ".tmp-" in n]


def test_sigkill_during_save_never_leaves_unloadable_last(tmp_path):
    ctx = mp.get_context("fork")  # a real separate process, without re-importing torch 15 times
    path = str(tmp_path / "last.ckpt")
    saved = ctx.Value("q", 0)
    rng = random.Random(0)
    temporaries_seen = 0
    verifier = SafetensorsCheckpointIO()
    for _ in range(15):
        started = ctx.Event()
        proc = ctx.Process(target=_save_forever, args=(path, started, saved), daemon=True)
        proc.start()
        assert started.wait(30)
        time.sleep(rng.uniform(0.0, 0.4))
        proc.kill()
        proc.join(10)
        assert proc.exitcode == -9
        temporaries_seen += bool(_temporaries(str(tmp_path)))
        if not os.path.exists(path):
            assert saved.value == 0, "a completed save disappeared"
            continue
        verifier.verify_checkpoint(path)
        ck = load_file(path).checkpoint
        assert ck["global_step"] >= saved.value  # never older than the last save reported complete
        assert torch.all(ck["state_dict"]["w"] == float(ck["global_step"])), "a file mixes two saves"
    assert saved.value > 0 and os.path.exists(path)
    assert temporaries_seen > 0, "no kill landed mid-write; the test did not exercise the crash path"
    SafetensorsCheckpointIO().save_checkpoint({"x": 1}, str(tmp_path / "other.ckpt"))  # first touch cleans
    assert _temporaries(str(tmp_path)) == []


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
    dead = tmp_path / ".x.ckpt.tmp-999999999-0123abcd"
    live = tmp_path / temp_name("y.ckpt")  # our own pid: a save in flight
    other = tmp_path / ".x.ckpt.tmp-notours"
    for p in (dead, live, other):
        p.write_bytes(b"")
    assert clean_stale_temporaries(str(tmp_path)) == [str(dead)]
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, other.name])


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
