"""Upload throughput to S3 of ``SafetensorsCheckpointIO`` against ``s3fs.put`` of the same bytes.

A local moto S3 server (``tests/helpers/s3.py``, 127.0.0.1, no network) receives, interleaved,
``--repeats`` times: (1) ``s3fs.put`` of a local file holding the tensors' raw bytes (the baseline:
no format, no checksums, s3fs's own multi-part upload); (2) a synchronous save through
``SafetensorsCheckpointIO`` (encode, checksum, upload, commit); (3) an async save: the training
thread's blocked time and the total until the upload is committed; (4) a raw memcpy of the same
tensors into preallocated buffers (the floor for the blocked time). Medians and ratios to the
baselines of the same run. The server shares the machine's cores with the client, so absolute figures say
little; the ratio is what to read.

Usage: ``python benchmarks/bench_s3.py --size-mb 256 --repeats 3`` (needs ``moto[server]`` and ``s3fs``).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
import uuid

import fsspec
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.flat_state import flat_state, memcpy_seconds, size_parser
from lightning_resume import SafetensorsCheckpointIO
from tests.helpers.s3 import S3Server, s3_env


def main() -> None:
    args = size_parser(__doc__, size_mb=64, repeats=3).parse_args()
    server = S3Server()
    os.environ.update(s3_env(server.endpoint))
    server.start()
    try:
        run(args.size_mb, args.repeats)
    finally:
        server.stop()


def run(size_mb: int, repeats: int) -> None:
    fs = fsspec.filesystem("s3")
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    fs.mkdir(bucket)
    state = flat_state(size_mb)
    raw = b"".join(t.numpy().tobytes() for t in state["state_dict"].values())
    times: dict = {"s3fs.put": [], "sync save": [], "async blocked": [], "async total": [], "memcpy": []}
    buffers = {k: torch.empty_like(v) for k, v in state["state_dict"].items()}
    sync_io, async_io = SafetensorsCheckpointIO(), SafetensorsCheckpointIO(async_save=True)
    with tempfile.NamedTemporaryFile() as local:
        local.write(raw)
        local.flush()
        for r in range(repeats):
            t = time.perf_counter()
            fs.put(local.name, f"{bucket}/raw-{r}.bin")
            times["s3fs.put"].append(time.perf_counter() - t)
            t = time.perf_counter()
            sync_io.save_checkpoint(state, f"s3://{bucket}/sync-{r}.ckpt")
            times["sync save"].append(time.perf_counter() - t)
            t = time.perf_counter()
            async_io.save_checkpoint(state, f"s3://{bucket}/async-{r}.ckpt")
            times["async blocked"].append(time.perf_counter() - t)
            async_io.wait()
            times["async total"].append(time.perf_counter() - t)
            times["memcpy"].append(memcpy_seconds(state, buffers))
    async_io.teardown()
    base = statistics.median(times["s3fs.put"])
    mb = len(raw) / (1 << 20)
    print(f"| {mb:.0f} MB to moto S3 | median s | MB/s | ratio to s3fs.put |")
    print("|---|---|---|---|")
    for name, values in times.items():
        m = statistics.median(values)
        print(f"| {name} | {m:.3f} | {mb / m:.0f} | {m / base:.2f}x |")
    blocked, copy = statistics.median(times["async blocked"]), statistics.median(times["memcpy"])
    print(f"\nasync blocked / memcpy into preallocated buffers: {blocked / copy:.2f}x")


if __name__ == "__main__":
    main()
