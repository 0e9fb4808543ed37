"""Upload throughput to S3 of ``SafetensorsCheckpointIO`` against raw uploads of the same bytes.

A local moto S3 server (``tests/helpers/s3.py``, 127.0.0.1, no network) receives, interleaved,
``--repeats`` times: (1) a raw parallel multi-part put of the tensors' raw bytes from memory
(``s3fs.pipe_file`` with the part size and concurrency of ``storage.multipart.DEFAULT_UPLOAD``: no format, no
checksums); (2) the same put one part at a time (a single stream); (3) ``s3fs.put`` of a local file holding
those bytes (s3fs's defaults, the baseline of earlier runs); (4) a synchronous save through
``SafetensorsCheckpointIO`` (encode, checksum, parallel multi-part upload, commit); (5) an async save: the
training thread's blocked time and the total until the upload is committed; (6) a raw memcpy of the same
tensors into preallocated buffers (the floor for the blocked time). Medians (min-max) and throughput ratios
to the baselines of the same run, with the load average. The server runs in a child process (``--server
thread``: in this one, sharing the client's GIL, as the tests run it); it shares the machine's cores with
the client either way, so absolute figures say little; the ratios are what to read. On 127.0.0.1 one stream is
as fast as the server's CPU, so parallel parts gain little; ``--stream-mbps`` caps each connection (a thread
server, ``Throttle``) as a distant store's link does, which is where parallel parts pay.

Usage: ``python benchmarks/bench_s3.py --size-mb 256 --repeats 3`` (needs ``moto[server]`` and ``s3fs``).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Dict, Iterator, List

import fsspec
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.flat_state import flat_state, memcpy_seconds, size_parser
from lightning_resume import SafetensorsCheckpointIO
from lightning_resume.storage.multipart import DEFAULT_UPLOAD
from tests.helpers.paths import free_port
from tests.helpers.s3 import S3Server, s3_env


def main() -> None:
    parser = size_parser(__doc__, size_mb=64, repeats=3)
    parser.add_argument("--server", choices=("thread", "process"), default="process")
    parser.add_argument("--stream-mbps", type=float, default=0.0, help=Throttle.__doc__)
    args = parser.parse_args()
    where = "thread" if args.stream_mbps else args.server
    with s3_endpoint(where, args.stream_mbps) as endpoint:
        os.environ.update(s3_env(endpoint))
        run(
            args.size_mb, args.repeats, where if not args.stream_mbps else f"thread, {args.stream_mbps:g} MB/s a stream"
        )


class Throttle:
    """Emulated per-connection bandwidth (MB/s, a thread server only): each request's body (PUT, POST) and each
    GET's answer is held ``bytes / rate`` s, sleeping, so a stream moves at most that rate, as one connection to
    a distant store does, and only parallel streams go faster. 0: off."""

    def __init__(self, mbps: float) -> None:
        self.rate = mbps * (1 << 20)

    def wrap(self, app):
        def middleware(environ, start_response):
            method = environ.get("REQUEST_METHOD")
            if method in ("PUT", "POST"):
                time.sleep(int(environ.get("CONTENT_LENGTH") or 0) / self.rate)
            body = app(environ, start_response)
            if method != "GET":
                return body
            chunks = list(body)
            time.sleep(sum(map(len, chunks)) / self.rate)
            return chunks

        return middleware


@contextlib.contextmanager
def s3_endpoint(where: str, stream_mbps: float = 0.0) -> Iterator[str]:
    """A moto server on 127.0.0.1: in a thread of this process (``tests/helpers/s3.py``, throttled per stream
    with ``stream_mbps``) or a child process."""
    if where == "thread":
        server = S3Server()
        server.start()
        if stream_mbps:
            wsgi = server._server._server
            wsgi.app = Throttle(stream_mbps).wrap(wsgi.app)
        try:
            yield server.endpoint
        finally:
            server.stop()
        return
    port = free_port()
    child = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        endpoint = f"http://127.0.0.1:{port}"
        wait_for(endpoint)
        yield endpoint
    finally:
        child.terminate()
        child.wait(30)


def wait_for(endpoint: str, timeout: float = 30.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run(size_mb: int, repeats: int, server: str) -> None:
    fs = fsspec.filesystem("s3")
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    fs.mkdir(bucket)
    state = flat_state(size_mb)
    raw = b"".join(t.numpy().tobytes() for t in state["state_dict"].values())
    part, streams = DEFAULT_UPLOAD.part_size, DEFAULT_UPLOAD.concurrency
    names = ["raw multipart", "single stream", "s3fs.put", "sync save", "async total", "async blocked", "memcpy"]
    times: Dict[str, List[float]] = {name: [] for name in names}
    loads = []
    buffers = {k: torch.empty_like(v) for k, v in state["state_dict"].items()}
    sync_io, async_io = SafetensorsCheckpointIO(), SafetensorsCheckpointIO(save="async")
    with tempfile.NamedTemporaryFile() as local:
        local.write(raw)
        local.flush()
        for r in range(repeats):
            loads.append(os.getloadavg()[0])
            t = time.perf_counter()
            fs.pipe_file(f"{bucket}/raw-mp-{r}.bin", raw, chunksize=part, max_concurrency=streams)
            times["raw multipart"].append(time.perf_counter() - t)
            t = time.perf_counter()
            fs.pipe_file(f"{bucket}/raw-one-{r}.bin", raw, chunksize=part, max_concurrency=1)
            times["single stream"].append(time.perf_counter() - t)
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
    report(times, len(raw), part, streams, server, loads)


def report(times: Dict[str, List[float]], nbytes: int, part: int, streams: int, server: str, loads: list) -> None:
    mb = nbytes / (1 << 20)
    multi, single = statistics.median(times["raw multipart"]), statistics.median(times["single stream"])
    print(f"{mb:.0f} MB, parts of {part >> 20} MiB, {streams} in flight, moto in a {server};", end=" ")
    print(f"load average at each repeat {', '.join(f'{x:.2f}' for x in loads)}, after: {load_average()}")
    print("| upload | median s (min-max) | MB/s | throughput / raw multipart | / single stream |")
    print("|---|---|---|---|---|")
    for name, values in times.items():
        m = statistics.median(values)
        spread = f"{m:.3f} ({min(values):.3f}-{max(values):.3f})"
        ratios = "| |" if name in ("async blocked", "memcpy") else f"| {multi / m:.2f}x | {single / m:.2f}x |"
        print(f"| {name} | {spread} | {mb / m:.0f} {ratios}")
    blocked, copy = statistics.median(times["async blocked"]), statistics.median(times["memcpy"])
    print(f"\nasync blocked / memcpy into preallocated buffers: {blocked / copy:.2f}x")


if __name__ == "__main__":
    main()
