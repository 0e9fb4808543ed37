"""Atomic commit: SIGKILL at random moments of a save never leaves an unloadable "last" file."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time

import torch

from lightning_resume import SafetensorsCheckpointIO
from lightning_resume.format.read import load_file

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
