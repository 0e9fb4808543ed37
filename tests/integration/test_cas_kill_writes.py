"""kill -9 at random moments of background content-addressed saves: "last" always loads and is whole.

A child saves ``last.ckpt`` in a loop through ``SafetensorsCheckpointIO(save="async", dedupe=True)`` (a tensor that
changes at every save and a frozen one), logging each background write; the parent SIGKILLs it at random moments
(while a pack is written, between the pack and the checkpoint file, while the file is written) and loads
``last.ckpt`` in a fresh IO: every block it references is there and verifies, the frozen tensor was written once.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from lightning_resume import SafetensorsCheckpointIO
from lightning_resume.cas.refs import read_refs
from tests.helpers.kill_writes import durable_steps, kill_during_writes

pytestmark = [pytest.mark.multiprocess, pytest.mark.extended, pytest.mark.slow, pytest.mark.timeout(600)]

N = 2_000_000  # 8 MB per tensor: each write takes milliseconds to tens of them


def test_sigkill_during_background_dedupe_writes_leaves_last_loadable(tmp_path):
    rng, mid_write = random.Random(), 0
    for i in range(5):
        out = tmp_path / f"run{i}"
        out.mkdir()
        mid_write += kill_during_writes(out, str(out / "last.ckpt"), N, rng.uniform(0.0, 0.3), dedupe=True) == "begin"
        loaded = SafetensorsCheckpointIO().load_checkpoint(out / "last.ckpt")  # every block read and verified
        step = loaded["step"]
        assert step >= durable_steps(out)[-1]
        assert torch.equal(loaded["w"], torch.full((N,), float(step)))
        assert torch.equal(loaded["frozen"], torch.arange(N, dtype=torch.float32))
        refs = read_refs(str(out / "last.ckpt"))
        assert refs.tensors["frozen"].pack != refs.wrote or step == 1  # written once, by the first save
        blocks = sorted(os.listdir(out / "blocks"))
        assert all(n.endswith(".safetensors") or n.startswith(".pack.tmp-") for n in blocks), blocks
        SafetensorsCheckpointIO(dedupe=True).save_checkpoint(loaded, out / "last.ckpt")  # the next writer cleans
        assert not [n for n in os.listdir(out / "blocks") if n.startswith(".")]
    assert mid_write >= 2, f"only {mid_write} of 5 kills landed during a background write"
