"""What reading a file into memory never touched before costs on this machine, apart from the product.

A fresh interpreter per row reads ``--size-mb`` MB of a file that is in the page cache into a new
``torch.empty`` (``readinto`` in 256 KiB chunks, as ``format.read`` does), (a) holding nothing else and (b) after
allocating and filling a tensor of the same size first (as a resume does: the model is built, then the
checkpoint is read); and, as ``bench_first_step``'s raw read, into a buffer zeroed before the timer.
Medians (min-max) over ``--repeats``. On a VM whose guest memory is backed lazily, (b) is far slower than (a):
the cost behind the time-to-first-step ratio at 1 GB (benchmarks/RESULTS.md).

Usage: ``python benchmarks/bench_fresh_memory.py --size-mb 1024 --repeats 3``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHUNK = 1 << 18
MODES = ("new memory, nothing held", "new memory, a model of the same size held", "zeroed before the timer")


def child(path: str, mode: str) -> None:
    import torch

    torch.set_num_threads(1)
    size = os.path.getsize(path)
    if mode == MODES[1]:
        model = torch.randn(size // 4)  # noqa: F841 - held, as a resume holds its model
    if mode == MODES[2]:
        into = torch.zeros(size, dtype=torch.uint8)
    started = time.perf_counter()
    if mode != MODES[2]:
        into = torch.empty(size, dtype=torch.uint8)
    view = memoryview(into.numpy()).cast("B")
    with open(path, "rb", buffering=0) as f:
        got = 0
        while got < size and (k := f.readinto(view[got : got + CHUNK])):
            got += k
    print(time.perf_counter() - started)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(*a.child)
        return
    with tempfile.NamedTemporaryFile(dir=os.environ.get("BENCH_DIR")) as f:
        f.write(os.urandom(a.size_mb << 20))
        f.flush()
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(a.repeats):
            for mode in MODES:
                out = subprocess.run(
                    [sys.executable, __file__, "--child", f.name, mode], capture_output=True, text=True
                )
                times[mode].append(float(out.stdout))
    print(f"read of {a.size_mb} MB from the page cache; load average {os.getloadavg()[0]:.2f}")
    print("| destination | median s (min-max) |\n|---|---|")
    for mode, t in times.items():
        print(f"| {mode} | {statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f}) |")


if __name__ == "__main__":
    main()
