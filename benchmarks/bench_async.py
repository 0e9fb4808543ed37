"""Async saving: how long training is blocked, and how long until the file is durable.

One process, one state (``bench_io.make_state``: transformer-shaped fp32 weights plus AdamW moments),
every method interleaved ``--repeats`` times; medians and ratios to the two limits measured in the
same run:

- memcpy: the state's bytes copied (``ctypes.memmove``, one call per tensor) into preallocated,
  already-touched buffers. Nothing that snapshots the state can block for less.
- raw write+fsync: the same bytes written to one file through the page cache and fsync'd (no
  format, no checksums, no rename): the target's reference.
- raw O_DIRECT write+fsync: the same bytes, already in one block-aligned buffer, written with direct
  I/O and fsync'd: the disk's own limit (our async save writes this way), shown for honesty.

Ratios are of medians; the spread lines give the range of the per-repeat ratios (each save against
the baseline measured in the same round), since the machine is shared. The order of the methods
rotates from one round to the next. "blocked" is the time until ``save`` returns; "total" until the file is durable (or, for the peers
that do not fsync, written). ``os.sync()`` runs untimed before each measurement. Peers: our
synchronous save, ``torch.save`` (+fsync), Lightning ``TorchCheckpointIO`` (no fsync), Lightning
``AsyncCheckpointIO`` (clones the tensors on the caller, total = ``teardown``), and
``torch.distributed.checkpoint.async_save`` (``no_dist=True``, its default thread stager).

Then, blocked time alone over ``--saves`` interleaved saves (median and spread of each save's
ratio to the memcpy measured just before it), for this state, for one of ``--many-tensors``
small tensors (per-tensor overhead) and for a tiny state (``--tiny-mb``, ``--tiny-tensors``: fixed
costs), with peers; where the blocked time goes (tree encoding, reused
while the tree keeps its signature, layout, copy); the first save of a fresh process (pool not yet allocated)
with its peak extra RSS, and a later one; the slowdown of a CPU training step while a background
write runs (blocks of steps with and without a write in flight, interleaved, medians), with the
writer at lowered priority (the default) and at training's; and steps/s of a real Lightning fit
saving every ``--every`` steps.

Usage: ``python benchmarks/bench_async.py --size-mb 600 --repeats 5`` (defaults are small);
``--only small`` measures the small-tensor and tiny-state rows alone (``--size-mb`` sizes the first);
``--only writer`` the step-time row alone, for the writer thread against the writer process
(``writer="process"``), ``--rounds`` rounds of each, interleaved.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from benchmarks.bench_io import make_state, raw_write  # noqa: E402
from benchmarks.flat_state import model_state  # noqa: E402
from lightning_resume import SafetensorsCheckpointIO  # noqa: E402
from lightning_resume.format import write  # noqa: E402
from lightning_resume.format.codec import TreeEncoder  # noqa: E402
from lightning_resume.format.framing import host_bytes  # noqa: E402
from lightning_resume.staging.buffers import HostBuffers  # noqa: E402

Timing = Tuple[float, float]  # (blocked, total) seconds


# ---------------------------------------------------------------------------------------- methods


class Methods:
    """Each method saves ``state`` to a fresh path under ``root`` and returns (blocked, total)."""

    def __init__(self, state: Dict, root: str) -> None:
        self.state, self.root, self.n = state, root, 0
        self.tensors = every_tensor(state)
        self.views = [host_bytes(t) for t in self.tensors]
        self.buffers = [torch.empty_like(t).fill_(0) for t in self.tensors]  # preallocated and touched
        self.ours_async = SafetensorsCheckpointIO(save="async")
        self.nbytes = sum(len(v) for v in self.views)
        self.image = mmap.mmap(-1, -(-self.nbytes // 4096) * 4096)  # page-aligned: usable for O_DIRECT
        offset = 0
        for v in self.views:
            self.image[offset : offset + len(v)] = v
            offset += len(v)
        self.ours_sync = SafetensorsCheckpointIO()
        self.torch_io = TorchCheckpointIO()

    def path(self, ext: str = ".ckpt") -> str:
        self.n += 1
        return os.path.join(self.root, f"m{self.n}{ext}")

    def memcpy(self) -> Timing:
        t0 = time.perf_counter()
        for dst, src in zip(self.buffers, self.tensors):
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
        t = time.perf_counter() - t0
        return t, t

    def raw_write(self) -> Timing:
        t = _timed(lambda: raw_write(self.views, self.path()))
        return t, t

    def raw_direct(self) -> Timing:
        t = _timed(lambda: raw_direct_write(self.image, self.nbytes, self.path()))
        return t, t

    def ours_async_save(self) -> Timing:
        return _async(self.ours_async, self.state, self.path())

    def ours_sync_save(self) -> Timing:
        t = _timed(lambda: self.ours_sync.save_checkpoint(self.state, self.path()))
        return t, t

    def torch_save(self) -> Timing:
        path = self.path()

        def save() -> None:
            with open(path, "wb") as f:
                torch.save(self.state, f)
                f.flush()
                os.fsync(f.fileno())

        t = _timed(save)
        return t, t

    def lightning_torch_io(self) -> Timing:
        t = _timed(lambda: self.torch_io.save_checkpoint(self.state, self.path()))
        return t, t

    def lightning_async_io(self) -> Timing:
        io = AsyncCheckpointIO(TorchCheckpointIO())
        t0 = time.perf_counter()
        io.save_checkpoint(self.state, self.path())
        blocked = time.perf_counter() - t0
        io.teardown()
        return blocked, time.perf_counter() - t0

    def dcp_async_save(self) -> Timing:
        t0 = time.perf_counter()
        future = dcp.async_save(self.state, checkpoint_id=self.path(".dcp"), no_dist=True)
        blocked = time.perf_counter() - t0
        future.result()
        return blocked, time.perf_counter() - t0

    def clean(self) -> None:
        for name in os.listdir(self.root):
            shutil.rmtree(os.path.join(self.root, name)) if os.path.isdir(os.path.join(self.root, name)) else os.remove(
                os.path.join(self.root, name)
            )


def every_tensor(state: Dict) -> List[torch.Tensor]:
    """Every tensor a checkpoint of ``state`` holds (AdamW's scalar steps included: each costs a copy too)."""
    return list(write.encode_tree(state)[1].values())


def raw_direct_write(image: mmap.mmap, nbytes: int, path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
    try:
        view, chunk = memoryview(image), 32 << 20
        for a in range(0, len(image), chunk):
            os.pwrite(fd, view[a : a + chunk], a)
        os.ftruncate(fd, nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)


def _async(io: SafetensorsCheckpointIO, state: Dict, path: str) -> Timing:
    t0 = time.perf_counter()
    io.save_checkpoint(state, path)
    blocked = time.perf_counter() - t0
    io.wait()
    return blocked, time.perf_counter() - t0


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


ROWS = [
    ("memcpy into preallocated buffers (blocked limit)", "memcpy"),
    ("raw write+fsync (total limit)", "raw_write"),
    ("raw O_DIRECT write+fsync (disk limit)", "raw_direct"),
    ("SafetensorsCheckpointIO(save='async')", "ours_async_save"),
    ("SafetensorsCheckpointIO() sync", "ours_sync_save"),
    ("torch.save + fsync", "torch_save"),
    ("Lightning TorchCheckpointIO (no fsync)", "lightning_torch_io"),
    ("Lightning AsyncCheckpointIO (no fsync)", "lightning_async_io"),
    ("torch.distributed.checkpoint.async_save", "dcp_async_save"),
]
PEERS = [
    "torch_save",
    "lightning_torch_io",
    "lightning_async_io",
    "dcp_async_save",
]  # issue 6's list; our sync save is not a peer


def measure_saves(methods: Methods, repeats: int) -> Dict[str, List[Timing]]:
    results: Dict[str, List[Timing]] = {key: [] for _, key in ROWS}
    for key in results:  # warm-up: allocate pools, thread pools, first-touch pages (not counted)
        getattr(methods, key)()
        methods.clean()
    keys = [key for _, key in ROWS]
    for r in range(repeats):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:  # rotated: no method always follows another
            os.sync()
            results[key].append(getattr(methods, key)())
            methods.clean()
    return results


def save_table(results: Dict[str, List[Timing]], nbytes: int) -> Tuple[str, Dict[str, Tuple[float, float]]]:
    med = {k: (statistics.median(b for b, _ in v), statistics.median(t for _, t in v)) for k, v in results.items()}
    memcpy, raw = med["memcpy"][0], med["raw_write"][1]
    lines = [
        f"state: {nbytes / 1e6:.0f} MB, {len(results['memcpy'])} interleaved repeats, medians",
        "",
        "| method | blocked (s) | blocked / memcpy | total (s) | total / raw write+fsync | GB/s (total) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, key in ROWS:
        b, t = med[key]
        lines.append(f"| {label} | {b:.3f} | {b / memcpy:.2f}x | {t:.3f} | {t / raw:.2f}x | {nbytes / t / 1e9:.2f} |")
    return "\n".join(lines), med


def verdict(med: Dict[str, Tuple[float, float]], results: Dict[str, List[Timing]]) -> str:
    b, t = med["ours_async_save"]
    memcpy, raw, direct = med["memcpy"][0], med["raw_write"][1], med["raw_direct"][1]
    best_b = min(med[k][0] for k in PEERS)
    best_t = min(med[k][1] for k in PEERS)
    return "\n".join([
        f"- blocked {b / memcpy:.2f}x memcpy (target <= 1.15x): {'met' if b <= 1.15 * memcpy else 'NOT met'}",
        f"- total {t / raw:.2f}x raw write+fsync (target <= 1.5x): {'met' if t <= 1.5 * raw else 'NOT met'}; {t / direct:.2f}x raw O_DIRECT",
        f"- blocked vs best peer ({best_b:.3f}s): {'better' if b < best_b else 'NOT better'}",
        f"- total vs best peer ({best_t:.3f}s): {'better' if t < best_t else 'NOT better'}",
        "spread of per-repeat ratios (min-median-max):",
        *[f"- {key}: {_spread(results, key)}" for key in ("ours_async_save", "ours_sync_save")],
    ])  # fmt: skip


def _spread(results: Dict[str, List[Timing]], key: str) -> str:
    blocked = [b / m[0] for (b, _), m in zip(results[key], results["memcpy"])]
    total = [t / r[1] for (_, t), r in zip(results[key], results["raw_write"])]
    return f"blocked/memcpy {_range(blocked)}, total/raw write {_range(total)}"


def _range(xs: List[float]) -> str:
    return f"{min(xs):.2f}-{statistics.median(xs):.2f}-{max(xs):.2f}"


# ---------------------------------------------------------------------------------------- blocked time


def many_tensor_state(size_mb: float, n: int) -> Dict:
    """``n`` small tensors in all (a quarter parameters, each with AdamW's step, exp_avg, exp_avg_sq)."""
    k = max(1, n // 4)
    numel = max(1, int(size_mb * 1e6 / 4 / (3 * k)))
    params = {f"layers.{i}.weight": torch.empty(numel).uniform_(-1, 1) for i in range(k)}
    moments = {
        j: {"step": torch.tensor(10.0), "exp_avg": torch.empty(numel).uniform_(), "exp_avg_sq": torch.empty(numel)}
        for j in range(k)
    }
    groups = [{"lr": 1e-3, "params": list(moments)}]
    return {"global_step": 10, "state_dict": params, "optimizer_states": [{"state": moments, "param_groups": groups}]}


BLOCKED = ["ours_async_save", "lightning_async_io", "dcp_async_save"]


def measure_blocked(methods: Methods, saves: int) -> Dict[str, List[float]]:
    """Each save's blocked time over the memcpy measured just before it (rotated order; first saves not counted)."""
    ratios: Dict[str, List[float]] = {key: [] for key in BLOCKED}
    for key in BLOCKED:  # warm-up
        getattr(methods, key)()
        methods.clean()
    for r in range(saves):
        for key in BLOCKED[r % len(BLOCKED) :] + BLOCKED[: r % len(BLOCKED)]:
            os.sync()
            memcpy = statistics.median(methods.memcpy()[0] for _ in range(3))
            ratios[key].append(getattr(methods, key)()[0] / memcpy)
            methods.clean()
    return ratios


def blocked_lines(title: str, ratios: Dict[str, List[float]], goal: Optional[float] = 1.15) -> List[str]:
    """The spread of each method's ratios; the verdict against ``goal`` x memcpy, or (``None``) against
    Lightning's async IO (ours no longer blocked than it)."""
    ours = statistics.median(ratios["ours_async_save"])
    peers = {k: statistics.median(v) for k, v in ratios.items() if k != "ours_async_save"}
    lines = [f"{title}: blocked / memcpy over {len(ratios['ours_async_save'])} saves each (min-median-max)"]
    lines += [f"- {key}: {_range(v)}" for key, v in ratios.items()]
    if goal is None:
        vs = ours / peers["lightning_async_io"]
        lines.append(f"- ours / Lightning async <= 1.0x: {'met' if vs <= 1.0 else 'NOT met'} ({vs:.2f}x)")
    else:
        lines.append(f"- ours <= {goal}x: {'met' if ours <= goal else 'NOT met'}")
    lines.append(
        f"- better than every peer: {'yes' if all(ours < v for v in peers.values()) else 'NO'}; ours / peer "
        "(medians): " + ", ".join(f"{k} {ours / v:.2f}x" for k, v in peers.items())
    )
    return lines


def small_rows(args: argparse.Namespace, root: str) -> None:
    """Per-tensor and fixed costs: the ``--many-tensors`` state (goal <= 1.3x memcpy) and the tiny state
    (goal: no longer blocked than Lightning's async IO), each with where ours blocks."""
    rows: List[Tuple[str, Dict, Optional[float]]] = [
        ("small tensors", many_tensor_state(args.size_mb, args.many_tensors), 1.3),
        ("tensors, tiny state", many_tensor_state(args.tiny_mb, args.tiny_tensors), None),
    ]
    for title, state, goal in rows:
        tensors = every_tensor(state)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        ratios = measure_blocked(Methods(state, root), args.saves)
        head = f"{len(tensors)} {title}, {nbytes / 1e6:.1f} MB"
        print("\n" + "\n".join(blocked_lines(head, ratios, goal)))
        print("where ours blocks (after the first save):")
        print("\n".join(blocked_breakdown(state, args.repeats)))


def blocked_breakdown(state: Dict, repeats: int) -> List[str]:
    """Where the blocked time of one save goes, each part over memcpy (medians; pool warm, layout kept):
    the encoding as a later save gets it (reused while the signature holds), for reference the encoding in
    full (first save, or the signature changed), the layout and the copy."""
    tensors = every_tensor(state)
    buffers = [torch.empty_like(t).fill_(0) for t in tensors]
    pool, encoder = HostBuffers(), TreeEncoder()
    parts: Dict[str, List[float]] = {}
    for r in range(repeats + 2):
        t0 = time.perf_counter()
        for dst, src in zip(buffers, tensors):
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
        t1 = time.perf_counter()
        encoded = encoder.encode(state)
        t2 = time.perf_counter()
        staged = pool.prepare(encoded.tensors, encoded.layout)
        t3 = time.perf_counter()
        pool.fill(staged, encoded.tensors, encoded.pointers, encoded.plain)
        t4 = time.perf_counter()
        write.encode_tree(state)
        t5 = time.perf_counter()
        if r >= 2:  # the first round encodes in full and lays out the pool, the second keeps byte views
            for key, t in [
                ("memcpy", t1 - t0),
                ("encode", t2 - t1),
                ("prepare", t3 - t2),
                ("fill", t4 - t3),
                ("(encode in full)", t5 - t4),
            ]:
                parts.setdefault(key, []).append(t)
    memcpy = statistics.median(parts["memcpy"])
    return [f"- {key}: {statistics.median(v) / memcpy:.3f}x memcpy" for key, v in parts.items() if key != "memcpy"]


# ---------------------------------------------------------------------------------------- memory


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def peak_extra_rss(fn: Callable[[], object]) -> float:
    gc.collect()
    if not _reset_peak():
        return float("nan")
    before = _status("VmRSS")
    fn()
    return (_status("VmHWM") - before) / 1e6


MEMORY_PROBES = [
    "ours_async_first",
    "ours_async_first_reserved",
    "ours_async_reused",
    "lightning_async_io",
    "dcp_async_save",
]


def memory_probe(kind: str, size_mb: float, root: str) -> Tuple[float, float]:
    """Peak extra RSS (MB) of one save and its blocked time over memcpy, in this fresh process (so freed
    memory of other methods cannot hide it, and the first save finds no pool allocated)."""
    state = make_state(size_mb)
    tensors = every_tensor(state)
    buffers = [torch.empty_like(t).fill_(0) for t in tensors]
    memcpy = min(_timed(lambda: _memmove_all(buffers, tensors)) for _ in range(3))
    blocked: List[float] = []
    if kind == "lightning_async_io":
        rss = peak_extra_rss(lambda: blocked.append(_lightning_async_once(state, root)))
        return rss, blocked[0] / memcpy
    if kind == "dcp_async_save":
        rss = peak_extra_rss(lambda: blocked.append(_dcp_once(state, root)))
        return rss, blocked[0] / memcpy
    io = SafetensorsCheckpointIO(save="async")
    if kind == "ours_async_first_reserved":  # as ExactResume does after the first optimizer step
        io.reserve(int(sum(t.nbytes for t in tensors) * 1.01) + (16 << 20))
        io.wait()  # training steps run meanwhile; the first save then finds the pool touched

    def save_and_wait() -> None:
        blocked.append(_async(io, state, os.path.join(root, "rss.ckpt"))[0])

    first = peak_extra_rss(save_and_wait)
    if kind in ("ours_async_first", "ours_async_first_reserved"):
        return first, blocked[0] / memcpy
    return peak_extra_rss(save_and_wait), blocked[1] / memcpy


def _memmove_all(buffers: List[torch.Tensor], tensors: List[torch.Tensor]) -> None:
    for dst, src in zip(buffers, tensors):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())


def measure_memory(size_mb: float, root: str) -> Dict[str, Tuple[float, float]]:
    out = {}
    for kind in MEMORY_PROBES:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--memory-probe",
            kind,
            "--size-mb",
            str(size_mb),
            "--dir",
            root,
        ]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        lines = [line.split() for line in result.stdout.splitlines() if line.startswith("RSS ")]
        out[kind] = (float(lines[-1][1]), float(lines[-1][3])) if lines else (float("nan"), float("nan"))
    return out


def _lightning_async_once(state: Dict, root: str) -> float:
    io = AsyncCheckpointIO(TorchCheckpointIO())
    t0 = time.perf_counter()
    io.save_checkpoint(state, os.path.join(root, "la.ckpt"))
    blocked = time.perf_counter() - t0
    io.teardown()
    return blocked


def _dcp_once(state: Dict, root: str) -> float:
    t0 = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=os.path.join(root, "d.dcp"), no_dist=True)
    blocked = time.perf_counter() - t0
    future.result()
    return blocked


# ---------------------------------------------------------------------------------------- training


def step_slowdown(
    state: Dict, root: str, rounds: int = 8, block: int = 15, writers: bool = False, small: bool = False
) -> Dict[str, Tuple[float, float, float, float]]:
    """CPU training-step times with and without our background write of ``state`` in flight.

    Per round: ``block`` steps with no write, then a save and steps until its write is durable; the
    two kinds of block alternate, so a change in the machine's load hits both alike. Returns, for the
    writer at lowered priority (the default) and at the training thread's (``writers``: for the writer
    thread and the writer process, both at lowered priority), the median step time without a write, the
    median ratio of each round's steps during the write to that round's steps without, and the lowest and
    highest of those ratios. ``small``: a step of many small operators (12 layers of width 64, batch 8,
    about a millisecond), bound by Python and torch's dispatcher rather than by arithmetic, where sharing
    the GIL with a writer thread would show most.
    """
    torch.manual_seed(0)
    if small:
        model = nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(64, 64), nn.ReLU())])
        x = torch.randn(8, 64)
    else:
        model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))
        x = torch.randn(64, 512)
    opt = torch.optim.AdamW(model.parameters())

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        return time.perf_counter() - t0

    for _ in range(10):
        step()
    if writers:
        ios = {
            "thread (default)": SafetensorsCheckpointIO(save="async"),
            "process": SafetensorsCheckpointIO(save="async", writer="process"),
        }
    else:
        ios = {"lowered priority (default)": SafetensorsCheckpointIO(save="async")}
        same = SafetensorsCheckpointIO(save="async")
        same._saver.writer.nice = 0  # type: ignore[union-attr]  # the comparison: a writer at training's priority
        ios["training's priority"] = same
    for io in ios.values():  # warm-up: the pool allocated, the writer process started
        io.save_checkpoint(state, os.path.join(root, "warm.ckpt"))
        io.wait()
    os.remove(os.path.join(root, "warm.ckpt"))
    alone: Dict[str, List[float]] = {k: [] for k in ios}
    ratios: Dict[str, List[float]] = {k: [] for k in ios}
    for r in range(rounds):
        for key, io in ios.items():
            quiet = statistics.median(step() for _ in range(block))
            io.save_checkpoint(state, os.path.join(root, f"bg{r}.ckpt"))
            during: List[float] = []
            while io.write_in_flight() or len(during) < 3:
                during.append(step())
            io.wait()
            alone[key].append(quiet)
            ratios[key].append(statistics.median(during) / quiet)
            os.remove(os.path.join(root, f"bg{r}.ckpt"))
    for io in ios.values():
        io.teardown()
    return {k: (statistics.median(alone[k]), statistics.median(ratios[k]), min(ratios[k]), max(ratios[k])) for k in ios}


def writer_rows(size_mb: float, root: str, rounds: int) -> List[str]:
    """The step-time row for the writer thread against the writer process (``--only writer``)."""
    state = make_state(size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in every_tensor(state))
    lines = [
        f"training step (CPU, 1 thread) while a background write of {nbytes / 1e6:.0f} MB runs, vs without"
        f" (interleaved, {rounds} rounds, medians; range of the per-round ratios):"
    ]
    for small, step in ((False, "MLP 512-1024-512, batch 64"), (True, "12 small layers, batch 8")):
        lines.append(f"{step} (load average {os.getloadavg()[0]:.2f} at the start):")
        for key, (alone, ratio, low, high) in step_slowdown(state, root, rounds, writers=True, small=small).items():
            lines.append(
                f"- writer {key}: {alone * 1e3:.2f} ms alone, {ratio:.3f}x during a write (range {low:.3f}-{high:.3f})"
            )
    lines.append(
        f"save of the same state, blocked and until durable (medians of {rounds}, interleaved, after a warm-up):"
    )
    for key, (blocked, durable) in writer_save_times(state, root, rounds).items():
        lines.append(
            f"- writer {key}: blocked {_median_range(blocked, 1e3)} ms, durable {_median_range(durable, 1e3)} ms"
        )
    lines.append(f"(load average {os.getloadavg()[0]:.2f} at the end)")
    return lines


def writer_save_times(state: Dict, root: str, rounds: int) -> Dict[str, Tuple[List[float], List[float]]]:
    """Each writer's blocked and durable seconds per save of ``state`` (the first save of each untimed)."""
    ios = {
        "thread": SafetensorsCheckpointIO(save="async"),
        "process": SafetensorsCheckpointIO(save="async", writer="process"),
    }
    out: Dict[str, Tuple[List[float], List[float]]] = {k: ([], []) for k in ios}
    for r in range(rounds + 1):
        for key, io in ios.items():
            path = os.path.join(root, f"{key}.ckpt")
            started = time.perf_counter()
            io.save_checkpoint(state, path)
            blocked = time.perf_counter() - started
            io.wait()
            if r:
                out[key][0].append(blocked)
                out[key][1].append(time.perf_counter() - started)
    for io in ios.values():
        io.teardown()
    return out


def _median_range(xs: List[float], scale: float) -> str:
    return f"{statistics.median(xs) * scale:.1f} (range {min(xs) * scale:.1f}-{max(xs) * scale:.1f})"


class Fit(L.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)
        )

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def fit_steps_per_second(plugin, root: str, every: int, steps: int, width: int) -> float:
    torch.manual_seed(0)
    x = torch.randn(steps * 8, width)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    callbacks = (
        []
        if plugin == "none"
        else [ModelCheckpoint(dirpath=root, every_n_train_steps=every, save_top_k=1, monitor=None)]
    )
    trainer = L.Trainer(
        max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        devices=1, callbacks=callbacks, enable_checkpointing=plugin != "none",
        plugins=None if plugin in ("none", "lightning") else [plugin], default_root_dir=root,
    )  # fmt: skip
    t0 = time.perf_counter()
    trainer.fit(Fit(width), loader)  # includes the wait for the last write (teardown)
    elapsed = time.perf_counter() - t0
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root, exist_ok=True)
    return steps / elapsed


class NullCheckpointIO(TorchCheckpointIO):
    """Writes nothing: what Lightning's own checkpoint path costs (``dump_checkpoint``, ModelCheckpoint's
    bookkeeping) before any CheckpointIO runs, the floor of every row below it."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:  # type: ignore[no-untyped-def]
        return None

    def remove_checkpoint(self, path) -> None:  # type: ignore[no-untyped-def]
        return None


def measure_fits(root: str, every: int, steps: int, width: int, repeats: int) -> Dict[str, float]:
    kinds = {
        "no checkpoints": lambda: "none",
        "Lightning's checkpoint path, null CheckpointIO (floor)": lambda: NullCheckpointIO(),
        "Lightning default (TorchCheckpointIO)": lambda: "lightning",
        "Lightning AsyncCheckpointIO": lambda: AsyncCheckpointIO(TorchCheckpointIO()),
        "SafetensorsCheckpointIO() sync": lambda: SafetensorsCheckpointIO(),
        "SafetensorsCheckpointIO(save='async')": lambda: SafetensorsCheckpointIO(save="async"),
    }
    runs: Dict[str, List[float]] = {k: [] for k in kinds}
    names = list(kinds)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotated, as the saves
            runs[name].append(fit_steps_per_second(kinds[name](), root, every, steps, width))
    return {k: statistics.median(v) for k, v in runs.items()}


# ---------------------------------------------------------------------------------------- main


def overlap_rows(size_mb: float, saves: int, root: str) -> List[str]:
    """``save="overlapped"``: per save, the caller's time blocked at the save and at the barrier (the next optimizer
    step), against a memcpy of the same bytes measured just before it. The state is a real model and AdamW
    (so the optimizer watch defers it); between the save and the step, a forward/backward-sized CPU matmul."""
    state = model_state(size_mb)
    io = SafetensorsCheckpointIO(save="overlapped")
    plain = SafetensorsCheckpointIO(save="async")
    nbytes = state.nbytes
    rows: Dict[str, List[float]] = {"save": [], "barrier": [], "save+barrier": [], "async (no overlap)": []}
    for i in range(saves + 1):
        for b in state.buffers:
            b.zero_()
        memcpy = state.memcpy_seconds()
        ckpt = state.checkpoint()
        t0 = time.perf_counter()
        plain.save_checkpoint(ckpt, os.path.join(root, "plain.ckpt"))
        plain_blocked = time.perf_counter() - t0
        plain.wait()
        t0 = time.perf_counter()
        io.save_checkpoint(ckpt, os.path.join(root, "overlap.ckpt"))
        blocked = time.perf_counter() - t0
        state.model(state.x).sum().backward()  # the next forward/backward, overlapped with the copy
        stats = io._saver.end_copy() if io._saver is not None else None
        state.optimizer.step()
        io.wait()
        barrier = stats.barrier_seconds if stats is not None else 0.0
        if i:  # the first save allocates the pools
            rows["save"].append(blocked / memcpy)
            rows["barrier"].append(barrier / memcpy)
            rows["save+barrier"].append((blocked + barrier) / memcpy)
            rows["async (no overlap)"].append(plain_blocked / memcpy)
    io.teardown()
    plain.teardown()
    load = os.getloadavg()
    out = [
        f"save='overlapped', {nbytes / 1e6:.0f} MB (model + AdamW), {saves} saves, load {load[0]:.2f} {load[1]:.2f}:"
    ]
    for name, ratios in rows.items():
        ratios.sort()
        out.append(
            f"  {name:<20} median {statistics.median(ratios):.3f}x memcpy  (range {ratios[0]:.3f}-{ratios[-1]:.3f})"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=float, default=48.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where files are written (default: a temporary directory)")
    parser.add_argument("--every", type=int, default=10, help="fit: save every this many steps")
    parser.add_argument("--fit-steps", type=int, default=200)
    parser.add_argument(
        "--fit-width", type=int, default=1024, help="fit: hidden width (1024: 2.1M params, ~25 MB saved)"
    )
    parser.add_argument("--saves", type=int, default=12, help="blocked time: saves per method (after a warm-up)")
    parser.add_argument("--many-tensors", type=int, default=10_000, help="tensors in the small-tensor state")
    parser.add_argument("--tiny-mb", type=float, default=1.0, help="size of the tiny state")
    parser.add_argument("--tiny-tensors", type=int, default=84, help="tensors in the tiny state")
    parser.add_argument(
        "--only",
        choices=["all", "small", "overlap", "writer"],
        default="all",
        help="small / overlap / writer (step time during a write: writer thread vs process): those rows alone",
    )
    parser.add_argument("--rounds", type=int, default=8, help="writer: rounds of steps with and without a write")
    parser.add_argument("--fit-repeats", type=int, default=None, help="fit runs per kind (default: repeats // 2)")
    parser.add_argument("--memory-probe", choices=MEMORY_PROBES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_probe:
        rss, blocked = memory_probe(args.memory_probe, args.size_mb, args.dir or tempfile.gettempdir())
        print(f"RSS {rss} BLOCKED {blocked}")
        return
    root = tempfile.mkdtemp(prefix="bench_async_", dir=args.dir)
    if args.only == "overlap":
        try:
            print("\n".join(overlap_rows(args.size_mb, args.saves, root)))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return
    if args.only == "writer":
        try:
            print("\n".join(writer_rows(args.size_mb, root, args.rounds)))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return
    if args.only == "small":
        try:
            small_rows(args, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return
    try:
        state = make_state(args.size_mb)
        nbytes = sum(t.numel() * t.element_size() for t in every_tensor(state))
        methods = Methods(state, root)
        results = measure_saves(methods, args.repeats)
        table, med = save_table(results, nbytes)
        print(table + "\n\n" + verdict(med, results) + "\n")
        print("\n".join(blocked_lines(f"{nbytes / 1e6:.0f} MB state", measure_blocked(methods, args.saves))))
        del methods
        print("where ours blocks (after the first save):")
        print("\n".join(blocked_breakdown(state, args.repeats)))
        small_rows(args, root)
        mem = measure_memory(args.size_mb, root)
        print(f"\none save in a fresh process (state {nbytes / 1e6:.0f} MB): peak extra RSS, blocked / memcpy")
        for key, (mb, ratio) in mem.items():
            print(f"- {key}: {mb:.0f} MB ({mb * 1e6 / nbytes:.2f}x state), blocked {ratio:.2f}x memcpy")
        print(
            "  (ours_async_first allocates the reusable pool; ours_async_first_reserved finds it reserved in the"
            " background after the first optimizer step, as ExactResume has it done; ours_async_reused is every later save)"
        )
        print("\ntraining step (CPU MLP, 1 thread) while our background write runs, vs without (interleaved):")
        for key, (alone, ratio, _, _) in step_slowdown(state, root).items():
            print(f"- writer at {key}: {alone * 1e3:.2f} ms alone, {ratio:.2f}x during a write")
        fit_repeats = args.fit_repeats or max(1, args.repeats // 2)
        fits = measure_fits(root, args.every, args.fit_steps, args.fit_width, fit_repeats)
        print(f"\nLightning fit, {args.fit_steps} steps, save every {args.every} steps (steps/s, median):")
        for name, sps in fits.items():
            print(f"- {name}: {sps:.1f} ({sps / fits['no checkpoints']:.2f}x of no checkpoints)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
