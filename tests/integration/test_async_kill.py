"""kill -9 during background writes: the previous "last" stays loadable, every time.

A child process saves ``last.ckpt`` in a loop through the async IO (so its writer is busy nearly all
the time) and logs when each background write begins and ends; the parent SIGKILLs it at random
moments, then loads ``last.ckpt`` in a fresh IO and checks it is whole and self-consistent.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lightning_resume import SafetensorsCheckpointIO
from tests.helpers.paths import REPO_ROOT

ROOT = str(REPO_ROOT)

CHILD = textwrap.dedent(
    """
    import os, sys, torch
    torch.set_num_threads(1)
    from lightning_resume import SafetensorsCheckpointIO
    out = sys.argv[1]
    log = open(os.path.join(out, "events"), "a", buffering=1)
    class Logged(SafetensorsCheckpointIO):  # each background write, logged around the plugin's hook
        def _commit(self, path, tree_json, tensors):
            log.write(f"begin {int(tensors['w'][0])}\\n")
            super()._commit(path, tree_json, tensors)
            log.write(f"end {int(tensors['w'][0])}\\n")
    io = Logged(async_save=True)
    w = torch.zeros(4_000_000)  # 16 MB: each write takes tens of milliseconds
    for step in range(1, 100_000):
        w.fill_(step)
        io.save_checkpoint({"w": w, "step": step, "tag": [step, str(step)]}, os.path.join(out, "last.ckpt"))
    """
)


def _kill_during_writes(out: Path, delay: float) -> str:
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(out)], cwd=ROOT, env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while "end" not in _read(out / "events") and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return _read(out / "events").split()[-2]  # "begin" when the kill landed mid-write


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


@pytest.mark.slow
def test_sigkill_during_background_writes_leaves_last_loadable(tmp_path):
    rng, mid_write = random.Random(), 0
    for i in range(6):
        out = tmp_path / f"run{i}"
        out.mkdir()
        mid_write += _kill_during_writes(out, rng.uniform(0.0, 0.4)) == "begin"
        durable = [int(line.split()[1]) for line in _read(out / "events").splitlines() if line.startswith("end")]
        loaded = SafetensorsCheckpointIO().load_checkpoint(out / "last.ckpt")  # verifies every checksum
        step = loaded["step"]
        assert step >= durable[-1], "an older file than the newest durable write is under the final name"
        assert torch.equal(loaded["w"], torch.full((4_000_000,), float(step))) and loaded["tag"] == [step, str(step)]
        left = sorted(os.listdir(out))  # a reader never cleans: another host's save may be in flight
        assert left[-2:] == ["events", "last.ckpt"] and all(n.startswith(".last.ckpt.tmp-") for n in left[:-2]), left
        SafetensorsCheckpointIO().save_checkpoint(loaded, out / "last.ckpt")  # the next writer here cleans
        assert sorted(os.listdir(out)) == ["events", "last.ckpt"]  # the dead writer's temporary was removed
    assert mid_write >= 3, f"only {mid_write} of 6 kills landed during a background write"
