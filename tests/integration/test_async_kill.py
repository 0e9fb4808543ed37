"""kill -9 during background writes: the previous "last" stays loadable, every time.

A child process saves ``last.ckpt`` in a loop through the async IO (so its writer is busy nearly all
the time) and logs when each background write begins and ends; the parent SIGKILLs it at random
moments, then loads ``last.ckpt`` in a fresh IO and checks it is whole and self-consistent.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from lightning_resume import SafetensorsCheckpointIO
from tests.helpers.kill_writes import durable_steps, kill_during_writes

N = 4_000_000  # 16 MB: each write takes tens of milliseconds


@pytest.mark.slow
def test_sigkill_during_background_writes_leaves_last_loadable(tmp_path):
    rng, mid_write = random.Random(), 0
    for i in range(6):
        out = tmp_path / f"run{i}"
        out.mkdir()
        mid_write += kill_during_writes(out, str(out / "last.ckpt"), N, rng.uniform(0.0, 0.4)) == "begin"
        durable = durable_steps(out)
        loaded = SafetensorsCheckpointIO().load_checkpoint(out / "last.ckpt")  # verifies every checksum
        step = loaded["step"]
        assert step >= durable[-1], "an older file than the newest durable write is under the final name"
        assert torch.equal(loaded["w"], torch.full((N,), float(step))) and loaded["tag"] == [step, str(step)]
        left = sorted(os.listdir(out))  # a reader never cleans: another host's save may be in flight
        assert left[-2:] == ["events", "last.ckpt"] and all(n.startswith(".last.ckpt.tmp-") for n in left[:-2]), left
        SafetensorsCheckpointIO().save_checkpoint(loaded, out / "last.ckpt")  # the next writer here cleans
        assert sorted(os.listdir(out)) == ["events", "last.ckpt"]  # the dead writer's temporary was removed
    assert mid_write >= 3, f"only {mid_write} of 6 kills landed during a background write"
