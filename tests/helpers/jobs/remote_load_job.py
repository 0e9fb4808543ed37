"""The host-memory peak of one remote checkpoint load, measured in a fresh interpreter.

Usage: remote_load_job.py URL SIZE_MB [safetensors|torch.save]. Writes a checkpoint of ``SIZE_MB`` MB
(eight float32 tensors) to ``URL`` (``memory://...``, or ``s3://...`` with the endpoint in the environment),
loads a small one first (so every import and the filesystem instance exist before the measurement), resets
the kernel's peak-RSS counter (``/proc/self/clear_refs``), loads ``URL`` through ``SafetensorsCheckpointIO``
and prints one JSON line: the file's size, the RSS before, the peak RSS during the load, the seconds it
took and whether every tensor came back bitwise equal. RSS, not ``tracemalloc``: torch allocates tensor
memory outside Python's allocator, so ``tracemalloc`` would not see copies the load makes.
"""

from __future__ import annotations

import gc
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root holds ``tests``

import fsspec
import torch

from lightning_resume.io.plugin import SafetensorsCheckpointIO
from lightning_resume.storage import files as storage


def _state(size_mb: int) -> dict:
    n = size_mb * (1 << 20) // 4 // 8
    g = torch.Generator().manual_seed(size_mb)
    return {"state_dict": {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(8)}, "global_step": 1}


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    assert match is not None, field
    return int(match.group(1))


def _save(state: dict, url: str, fmt: str) -> None:
    if fmt == "safetensors":
        SafetensorsCheckpointIO().save_checkpoint(state, url)
    else:
        with fsspec.open(url, "wb") as f:
            torch.save(state, f)


def main(url: str, size_mb: int, fmt: str) -> None:
    io = SafetensorsCheckpointIO()
    warm = storage.join(storage.split(url)[0], "warm-up.ckpt")
    _save(_state(1), warm, fmt)
    io.load_checkpoint(warm)
    _save(_state(size_mb), url, fmt)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS counter starts again from the current RSS
    before = _status_kib("VmRSS")
    started = time.perf_counter()
    loaded = io.load_checkpoint(url)
    seconds = time.perf_counter() - started
    peak = _status_kib("VmHWM")
    expected = _state(size_mb)["state_dict"]
    equal = all(torch.equal(loaded["state_dict"][k], v) for k, v in expected.items())
    size = storage.size(url)
    print(
        json.dumps({"size": size, "rss_before": before << 10, "peak": peak << 10, "seconds": seconds, "equal": equal})
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "safetensors")
