"""Host memory of a remote checkpoint load: the peak RSS it adds, as a multiple of the file's size.

Each measurement runs in a fresh interpreter (``tests/helpers/jobs/remote_load_job.py``): it writes a
checkpoint of ``--size-mb`` MB, loads it through ``SafetensorsCheckpointIO`` and reports the peak RSS
during the load above the RSS before it (the kernel's ``VmHWM``, reset just before). The file's size is
the baseline (1.0x: the least a load that returns the tensors in host memory can hold). Sources:
``memory://`` (fsspec's in-process store) and ``s3://`` on a local moto server (``tests/helpers/s3.py``,
127.0.0.1, run in this process so its memory is not counted); formats: our safetensors and ``torch.save``.

Usage: ``python benchmarks/bench_remote_load.py --size-mb 64 --repeats 1`` (needs ``moto[server]`` and ``s3fs``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import uuid

import fsspec

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.flat_state import size_parser
from tests.helpers import processes
from tests.helpers.s3 import S3Server, s3_env

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "helpers", "jobs", "remote_load_job.py")


def measure(url: str, size_mb: int, fmt: str, env: dict) -> dict:
    """One load in a fresh interpreter: its size, peak above the RSS before, seconds, bitwise result."""
    out = processes.run([JOB, url, str(size_mb), fmt], timeout=600, env=env)
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    args = size_parser(__doc__, size_mb=64, repeats=1).parse_args()
    server = S3Server()
    env = s3_env(server.endpoint)
    os.environ.update(env)
    server.start()
    try:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        fsspec.filesystem("s3").mkdir(bucket)
        print(f"| source, format ({args.size_mb} MB) | peak RSS added / file size | seconds | bitwise |")
        print("|---|---|---|---|")
        for source in ("memory://bench", f"s3://{bucket}"):
            for fmt in ("safetensors", "torch.save"):
                runs = [measure(f"{source}/r{r}-{fmt}.ckpt", args.size_mb, fmt, env) for r in range(args.repeats)]
                ratio = statistics.median((m["peak"] - m["rss_before"]) / m["size"] for m in runs)
                seconds = statistics.median(m["seconds"] for m in runs)
                equal = all(m["equal"] for m in runs)
                print(f"| {source.split(':')[0]}, {fmt} | {ratio:.2f}x | {seconds:.2f} | {equal} |")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
