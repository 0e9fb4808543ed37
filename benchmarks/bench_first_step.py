"""Time to the first resumed step, and what a resume reads and holds, locally and from S3.

**Time to first step.** A fresh interpreter runs a Lightning fit with ``ExactResume``,
``RetentionCheckpoint(every_n_train_steps=1)`` and ``SafetensorsCheckpointIO``, ``fit(ckpt_path="last")``,
on a model whose state is ``--size-mb`` MB (a buffer, plus a small layer that trains), and exits at the end
of its first training step. Measured: the wall time from just before the parent starts it to that moment,
(a) resuming from a checkpoint of the state (``last`` resolves to it) and (b) the same script on an empty
directory (a fresh start); the baseline is (b) plus a raw read of the same bytes (locally one ``readinto`` of
the file; from S3 a raw parallel ranged download: GETs of ``storage.READ_CHUNK``, as many in flight as our
reader has). Interleaved ``--repeats`` times, medians (min-max), the load average with each.
Locally the file is in the page cache (it was just written) for the resume and the raw read alike.

**S3** (``--s3``): a moto server on 127.0.0.1 in this process (``tests/helpers/s3.py``) counts the bytes it
sends for GETs: the bytes a resume with ``"last"`` fetched, over the file's size. Then the load alone
(``read.load_file``, every checksum verified) against a raw parallel ranged download at the same
concurrency and a single-stream GET of the same object. moto copies the whole object for every ranged GET
(a real store does not), so the same three reads also go through a local fsspec filesystem (``benchlocal://``,
``LocalFileSystem`` under another protocol: the remote code path, ``storage.RangedReader`` included, over a
local file) to tell the reader's cost from moto's.

**Host memory** (``--memory-mb``, default off): peak RSS added by a local load of a state of that size,
each in a fresh interpreter (``VmHWM`` reset before the load), over the file's size: ours, ``torch.load``
(``mmap=False``) of a ``torch.save`` file of the same tensors, and Lightning's default
(``TorchCheckpointIO.load_checkpoint``, which is ``torch.load`` with ``map_location``); and from S3 (ours).

Usage: ``python benchmarks/bench_first_step.py --size-mb 256 --repeats 3 --s3 --memory-mb 1024``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, List

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

HERE = os.path.abspath(__file__)
PROTOCOL = "benchlocal"


# ------------------------------------------------------------------------------------------ the child


def child_fit(mode: str, dirpath: str, size_mb: int, out: str) -> None:
    """``prepare``: train one step and save it; ``resume``/``fresh``: ``fit(ckpt_path="last")``, stop after one step."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_resume import ExactResume, RetentionCheckpoint, SafetensorsCheckpointIO

    torch.set_num_threads(1)

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
            self.register_buffer("state", torch.randn(size_mb * (1 << 20) // 4, generator=torch.Generator()))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return ((self.layer(x) - y) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class FirstStep(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if mode != "prepare":
                Path(out).write_text(json.dumps({"t": time.time(), "step": trainer.global_step}))
                os._exit(0)  # nothing after the first step: no save, no teardown

    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)), batch_size=8)
    trainer = pl.Trainer(
        max_steps=1 if mode == "prepare" else 4,
        callbacks=[ExactResume(), RetentionCheckpoint(dirpath=dirpath, every_n_train_steps=1), FirstStep()],
        plugins=[SafetensorsCheckpointIO()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(Model(), data, ckpt_path=None if mode == "prepare" else "last")


def child_rss(kind: str, path: str) -> None:
    """Load ``path`` once (``ours``, ``torch.load`` or ``lightning``) and print the peak RSS it added."""
    import gc

    import torch
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from lightning_resume.format import read

    torch.set_num_threads(1)
    loaders: Dict[str, Callable[[], object]] = {
        "ours": lambda: read.load_file(path).checkpoint,
        "torch.load": lambda: torch.load(path, map_location="cpu", weights_only=True),
        "lightning": lambda: TorchCheckpointIO().load_checkpoint(path),
    }
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    started = time.perf_counter()
    state = loaders[kind]()
    seconds = time.perf_counter() - started
    print(json.dumps({"added": (_status_kib("VmHWM") - before) << 10, "seconds": seconds, "ok": bool(state)}))


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    assert match is not None, field
    return int(match.group(1))


# ----------------------------------------------------------------------------------------- the parent


def spawn(args: List[str], env: Dict[str, str]) -> float:
    """Run this file as a child with ``args``; the wall time it took (for a fit: to the end of its first step)."""
    started = time.time()
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        child = subprocess.run(
            [sys.executable, HERE, "--child", *args, out.name],
            env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
        )
        if child.returncode != 0:
            raise RuntimeError(f"child {args} failed:\n{child.stdout[-3000:]}{child.stderr[-3000:]}")
        text = Path(out.name).read_text()
    if not text:
        return time.time() - started
    result = json.loads(text)
    assert result["step"] >= 1, result
    return float(result["t"]) - started


def median_spread(values: List[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def loadavg() -> float:
    return os.getloadavg()[0]


def raw_local_read(path: str) -> float:
    buf = bytearray(os.path.getsize(path))
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        view, got = memoryview(buf), 0
        while got < len(buf) and (k := f.readinto(view[got:])):
            got += k
    return time.perf_counter() - started


def raw_parallel_get(url: str) -> float:
    """Ranged GETs of ``storage.READ_CHUNK`` into one buffer, as many in flight as ``storage.RangedReader`` has
    (one per chunk of its window), no hashing, no tensors: the same requests as our load, nothing else."""
    import concurrent.futures

    import fsspec

    from lightning_resume.storage import files as storage

    fs, key = fsspec.core.url_to_fs(url)
    size = fs.size(key)
    into = memoryview(bytearray(size))

    def get(a: int) -> None:
        b = min(a + storage.READ_CHUNK, size)
        into[a:b] = fs.cat_file(key, start=a, end=b)

    started = time.perf_counter()
    streams = storage.reader_window(size) // storage.READ_CHUNK
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        list(pool.map(get, range(0, size, storage.READ_CHUNK)))
    return time.perf_counter() - started


def single_get(url: str) -> float:
    import fsspec

    fs, key = fsspec.core.url_to_fs(url)
    started = time.perf_counter()
    if hasattr(fs, "call_s3"):
        fs.cat_file(key, max_concurrency=1)  # one GET of the whole object (s3fs would split it otherwise)
    else:
        fs.cat_file(key)
    return time.perf_counter() - started


def our_load(url: str) -> float:
    from lightning_resume.format import read

    started = time.perf_counter()
    read.load_file(url)
    return time.perf_counter() - started


def newest(dirpath: str) -> str:
    from lightning_resume.storage import files as storage

    names = sorted(e.name for e in storage.list_dir(dirpath) if e.name.endswith(".ckpt") and "step=" in e.name)
    return storage.join(dirpath, names[-1])


def first_step(base: str, size_mb: int, repeats: int, env: Dict[str, str], traffic=None) -> Dict[str, List[float]]:
    """Interleaved: resume from ``base/ckpt``, fresh start on an empty directory, raw read of the checkpoint."""
    from lightning_resume.storage import files as storage

    ckpt = storage.join(base, "ckpt")
    spawn(["fit", "prepare", ckpt, str(size_mb)], env)
    path = newest(ckpt)
    raw = raw_local_read if storage.is_local(path) else raw_parallel_get
    out: Dict[str, List[float]] = {"resume": [], "fresh": [], "raw": [], "load": [], "fetched": []}
    for r in range(repeats):
        out["load"].append(loadavg())
        before = traffic.get_bytes if traffic is not None else 0
        out["resume"].append(spawn(["fit", "resume", ckpt, str(size_mb)], env))
        if traffic is not None:
            out["fetched"].append((traffic.get_bytes - before) / storage.size(path))
        out["fresh"].append(spawn(["fit", "fresh", storage.join(base, f"empty-{r}"), str(size_mb)], env))
        out["raw"].append(raw(path))
    return out


def print_first_step(where: str, size_mb: int, m: Dict[str, List[float]]) -> None:
    resume, fresh, raw = (statistics.median(m[k]) for k in ("resume", "fresh", "raw"))
    print(f"\n{where}, {size_mb} MB state; load average {', '.join(f'{x:.2f}' for x in m['load'])}")
    print("| figure | median s (min-max) |\n|---|---|")
    print(f"| resume: process start to first resumed step | {median_spread(m['resume'])} |")
    print(f"| fresh start of the same script | {median_spread(m['fresh'])} |")
    print(f"| raw read of the checkpoint's bytes | {median_spread(m['raw'])} |")
    ratios = [a / (b + c) for a, b, c in zip(m["resume"], m["fresh"], m["raw"], strict=True)]
    print(
        f"| resume / (fresh + raw read) | {resume / (fresh + raw):.2f}x (per repeat {min(ratios):.2f}-{max(ratios):.2f}) |"
    )
    if m["fetched"]:
        print(f"| bytes fetched from S3 by the resume / file size | {median_spread(m['fetched'])}x |")


def throughput(url: str, repeats: int) -> Dict[str, List[float]]:
    out: Dict[str, List[float]] = {"ours": [], "raw parallel": [], "single GET": [], "load": []}
    for _ in range(repeats):
        out["load"].append(loadavg())
        out["ours"].append(our_load(url))
        out["raw parallel"].append(raw_parallel_get(url))
        out["single GET"].append(single_get(url))
    return out


def print_throughput(where: str, url: str, m: Dict[str, List[float]]) -> None:
    from lightning_resume.storage import files as storage

    mb = storage.size(url) / (1 << 20)
    ours = statistics.median(m["ours"])
    print(f"\n{where}: load of {mb:.0f} MB; load average {', '.join(f'{x:.2f}' for x in m['load'])}")
    print("| read | median s (min-max) | MB/s | our throughput / its |\n|---|---|---|---|")
    for name in ("ours", "raw parallel", "single GET"):
        med = statistics.median(m[name])
        print(f"| {name} | {median_spread(m[name])} | {mb / med:.0f} | {med / ours:.2f}x |")


def memory(size_mb: int, base: str, s3_base: str, env: Dict[str, str]) -> None:
    import torch

    from lightning_resume import SafetensorsCheckpointIO
    from lightning_resume.storage import files as storage

    g = torch.Generator().manual_seed(0)
    n = size_mb * (1 << 20) // 4 // 8
    state = {"state_dict": {f"l{i}": torch.randn(n, generator=g) for i in range(8)}, "global_step": 1}
    ours, legacy = os.path.join(base, "state.ckpt"), os.path.join(base, "state.pt")
    SafetensorsCheckpointIO().save_checkpoint(state, ours)
    torch.save(state, legacy)
    rows = [("local, ours (SafetensorsCheckpointIO)", "ours", ours), ("local, torch.load", "torch.load", legacy)]
    rows.append(("local, Lightning's default (TorchCheckpointIO)", "lightning", legacy))
    if s3_base:
        remote = storage.join(s3_base, "state.ckpt")
        SafetensorsCheckpointIO().save_checkpoint(state, remote)
        rows.append(("S3 (moto), ours", "ours", remote))
    del state
    print(f"\nPeak RSS added by a load, {size_mb} MB state, fresh interpreter each; load average {loadavg():.2f}")
    print("| load | peak RSS added / file size | seconds |\n|---|---|---|")
    for label, kind, path in rows:
        out = subprocess.run(
            [sys.executable, HERE, "--child", "rss", kind, path],
            env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        result = json.loads(out.strip().splitlines()[-1])
        print(f"| {label} | {result['added'] / storage.size(path):.2f}x | {result['seconds']:.2f} |")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        if sys.argv[2] == "fit":
            child_fit(sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6])
        else:
            child_rss(sys.argv[3], sys.argv[4])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--s3", action="store_true")
    parser.add_argument("--memory-mb", type=int, default=0)
    parser.add_argument("--no-first-step", action="store_true", help="only the throughput and memory figures")
    parser.add_argument(
        "--stream-mbps",
        type=float,
        default=0.0,
        help="per-stream bandwidth of the S3 server and benchlocal:// (benchmarks/bench_s3.py, Throttle); 0: off",
    )
    args = parser.parse_args()
    _register_local_protocol(args.stream_mbps)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        if args.no_first_step:
            spawn(["fit", "prepare", os.path.join(tmp, "ckpt"), str(args.size_mb)], {})
        else:
            print_first_step("local disk", args.size_mb, first_step(tmp, args.size_mb, args.repeats, {}))
        local_url = f"{PROTOCOL}://{newest(os.path.join(tmp, 'ckpt'))}"
        print_throughput(
            "local file through the remote code path (benchlocal://)", local_url, throughput(local_url, args.repeats)
        )
        if args.s3:
            _with_s3(args, tmp)
        elif args.memory_mb:
            memory(args.memory_mb, tmp, "", {})


def _with_s3(args: argparse.Namespace, tmp: str) -> None:
    import fsspec

    from tests.helpers.s3 import S3Server, s3_env

    server = S3Server()
    env = s3_env(server.endpoint)
    os.environ.update(env)
    server.start()
    if args.stream_mbps:
        from benchmarks.bench_s3 import Throttle

        wsgi = server._server._server
        wsgi.app = Throttle(args.stream_mbps).wrap(wsgi.app)
    try:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        fsspec.filesystem("s3").mkdir(bucket)
        if args.s3:
            base = f"s3://{bucket}/first-step"
            if args.no_first_step:
                spawn(["fit", "prepare", f"{base}/ckpt", str(args.size_mb)], env)
            else:
                m = first_step(base, args.size_mb, args.repeats, env, server.traffic)
                print_first_step("S3 (moto on 127.0.0.1, in the parent)", args.size_mb, m)
            url = newest(f"{base}/ckpt")
            print_throughput("S3 (moto)", url, throughput(url, args.repeats))
        if args.memory_mb:
            memory(args.memory_mb, tmp, f"s3://{bucket}/memory", env)
    finally:
        server.stop()


def _register_local_protocol(stream_mbps: float = 0.0) -> None:
    """``benchlocal://``: local files behind a filesystem that is not a ``LocalFileSystem``, so ``storage`` takes
    its remote path (ranged ``cat_file`` reads through ``storage.RangedReader``) with no server in between; with
    ``stream_mbps`` each read is held ``bytes / rate`` s (sleeping), one stream's bandwidth."""
    import fsspec
    from fsspec.spec import AbstractFileSystem

    class BenchLocal(AbstractFileSystem):
        protocol = PROTOCOL

        def info(self, path, **kwargs):
            st = os.stat(self._strip_protocol(path))
            kind = "directory" if os.path.isdir(self._strip_protocol(path)) else "file"
            return {"name": self._strip_protocol(path), "size": st.st_size, "type": kind, "mtime": st.st_mtime}

        def ls(self, path, detail=True, **kwargs):
            root = self._strip_protocol(path)
            infos = [self.info(os.path.join(root, n)) for n in sorted(os.listdir(root))]
            return infos if detail else [i["name"] for i in infos]

        def cat_file(self, path, start=None, end=None, **kwargs):
            with open(self._strip_protocol(path), "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                a = 0 if start is None else start
                b = size if end is None else min(end, size)
                data = os.pread(f.fileno(), max(b - a, 0), a)
            if stream_mbps:
                time.sleep(len(data) / (stream_mbps * (1 << 20)))
            return data

        def _open(self, path, mode="rb", **kwargs):
            return open(self._strip_protocol(path), mode)

    fsspec.register_implementation(PROTOCOL, BenchLocal, clobber=True)


if __name__ == "__main__":
    main()
