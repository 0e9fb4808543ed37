"""Time a save costs a Lightning fit, as users run it: ``ExactResume`` + ``ModelCheckpoint`` + a CheckpointIO.

A Lightning fit of an MLP whose fp32 weights are ``--params-mb`` (AdamW: three times that in state) on CPU,
one thread, saving every ``--every`` steps; each fit runs in a fresh process of its own (no thread, pool or
process group of one fit reaches the next). Each step's wall time is taken from one batch start to the next.
A save's window is the step that saved and the steps after it up to ``--window`` steps, longer while its
write is still in flight; "time lost per save" is the sum over the window of (step time - the median step
time of the same fit's steps outside any window), reported as a ratio to a memcpy of the state's bytes
(``ctypes.memmove`` into preallocated, touched buffers: the least any snapshot can block), measured in each
fit after its first step; the ratio uses the median of those over all fits of the run, the same for every
row (one fit's own memcpy swings too much on this machine to divide by). The first save of each fit is left out (its staging memory is new).
Median and spread over the saves of ``--repeats`` fits per configuration, configurations interleaved.

Then, per configuration, each step k after a save over the calm step (k = 0 is the step that saved; with
``save="overlapped"`` k = 1 runs beside the copy and its optimizer step hands over the write): where the time goes.

Also per configuration: ExactResume's own part of each save (its ``state_dict``, on the training thread)
over the same memcpy; the training step while a write runs (steps that start with a write in flight, the
saving step left out) over the undisturbed step; and the fit's steps/s over whole save periods (from the
second save's step to the last's) against the floor: the same fit through Lightning's checkpoint path with a
``CheckpointIO`` that writes nothing.

Configurations: ``SafetensorsCheckpointIO`` with ``save="async"`` and ``"overlapped"``, with and without
``ExactResume``; Lightning's ``AsyncCheckpointIO`` and default ``TorchCheckpointIO`` with ``ExactResume``;
``torch.distributed.checkpoint.async_save`` of the model and optimizer every ``--every`` steps from a
callback (thread staging; process staging, which needs a process group: a one-rank gloo group in that
fit's process), the peer as its users run it, without ``ExactResume``; the null-IO floor; the machine's
limit (``BareCopyWrite``: the floor plus a bare thread copy of the state overlapped until the next optimizer
step, then a raw direct-I/O write and fsync of its bytes: what copying and writing the state costs this
machine's training steps, with no format, checksum or bookkeeping); no checkpoints.

A fit's speed drifts on a shared machine by more than what separates two saves (the same configuration lost
0.5x to 3.5x a memcpy per save in different runs), so the ``paired`` configuration runs both in one fit: our
overlapped save every ``2 * --every`` steps and the machine limit at the steps halfway between, each judged
against the same calm steps; the report gives the limit's saves as a row of their own and, per fit, the
difference between the two (``--only paired``).

Usage: ``python benchmarks/bench_save_in_fit.py --params-mb 300 --steps 61 --repeats 2`` (defaults are small).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import xxhash

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType  # noqa: E402

from benchmarks.flat_state import Wide  # noqa: E402
from lightning_resume import ExactResume, SafetensorsCheckpointIO  # noqa: E402

FLOOR = "ExactResume + null CheckpointIO (Lightning's checkpoint path, writes nothing: the floor)"
BARE = "machine limit: the floor + a bare thread copy until the next optimizer step, then a raw O_DIRECT write"
NONE = "no checkpoints"
PAIRED = "paired: ExactResume + SafetensorsCheckpointIO(save='overlapped'), the limit between its saves"


class StepClock(Callback):
    """Every batch start's time, whether a write was in flight then (``probe``), and the batches that saved."""

    def __init__(self, probe: Callable[[pl.Trainer], bool]) -> None:
        self.starts: List[float] = []
        self.in_flight: List[bool] = []
        self.saves: List[int] = []
        self.bare_saves: List[int] = []
        """With ``Config.paired``: the batches whose end started the machine limit's save."""
        self.probe = probe

    def on_train_batch_start(self, trainer, *args) -> None:
        self.starts.append(time.perf_counter())
        self.in_flight.append(self.probe(trainer))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.saves.append(len(self.starts) - 1)  # the batch index whose end saved


class TimedExactResume(ExactResume):
    """``ExactResume`` whose part of each save (its ``state_dict``, on the training thread) is timed."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seconds: List[float] = []

    def state_dict(self):
        t0 = time.perf_counter()
        out = super().state_dict()
        self.seconds.append(time.perf_counter() - t0)
        return out


def memcpy_seconds(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> float:
    """A copy of every weight and optimizer tensor into preallocated, touched buffers."""
    tensors = _state_tensors(model, optimizer)
    buffers = [torch.empty_like(t).fill_(0) for t in tensors]
    t0 = time.perf_counter()
    for dst, src in zip(buffers, tensors):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    return time.perf_counter() - t0


class MemcpyAfterFirstStep(Callback):
    """The memcpy baseline, measured once the optimizer state exists (after the first step)."""

    def __init__(self) -> None:
        self.seconds: Optional[float] = None

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if self.seconds is None:
            self.seconds = memcpy_seconds(pl_module, trainer.optimizers[0])


class NullCheckpointIO(TorchCheckpointIO):
    """Writes nothing: Lightning's checkpoint path (``dump_checkpoint``, ModelCheckpoint's bookkeeping,
    ExactResume's part) before any CheckpointIO runs, the floor of every row."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        return None

    def remove_checkpoint(self, path) -> None:
        return None


class CountedTorchIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO``, counting the writes queued and not yet done (for ``AsyncCheckpointIO``)."""

    def __init__(self) -> None:
        super().__init__()
        self.pending = 0

    def save_checkpoint(self, *args, **kwargs) -> None:
        try:
            super().save_checkpoint(*args, **kwargs)
        finally:
            self.pending -= 1


class CountedAsyncIO(AsyncCheckpointIO):
    def __init__(self) -> None:
        self.counted = CountedTorchIO()
        super().__init__(self.counted)

    def save_checkpoint(self, *args, **kwargs) -> None:
        self.counted.pending += 1
        super().save_checkpoint(*args, **kwargs)


class DcpEvery(Callback):
    """``dcp.async_save`` of the model and optimizer every ``every`` steps, one save in flight (the next
    waits for it, as ours does): how a DCP user checkpoints a fit."""

    def __init__(self, root: str, every: int, kind: AsyncCheckpointerType, clock: StepClock) -> None:
        self.root, self.every, self.kind, self.clock = root, every, kind, clock
        self.future: Any = None

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step % self.every:
            return
        self.wait()
        state = {"model": pl_module.state_dict(), "optim": trainer.optimizers[0].state_dict()}
        path = os.path.join(self.root, f"step{trainer.global_step}.dcp")
        process = self.kind == AsyncCheckpointerType.PROCESS
        self.future = dcp.async_save(state, checkpoint_id=path, no_dist=not process, async_checkpointer_type=self.kind)
        self.clock.saves.append(len(self.clock.starts) - 1)

    def in_flight(self) -> bool:
        return self.future is not None and not self.future.done()

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None

    def on_train_end(self, *args) -> None:
        self.wait()


class BareCopyWrite(Callback):
    """The machine's limit for a save that copies the state while the next step runs and then writes it:
    every ``every`` steps, a thread copies every weight and optimizer tensor into one preallocated,
    page-aligned buffer (``copy_``, which releases the GIL) while the next forward/backward runs; the next
    optimizer step waits for it; then a thread writes the buffer with direct I/O (16 MiB ``os.write`` calls)
    and fsyncs it. No format, no checksums, no rename: what no real save can undercut on this machine.

    ``hash``: also an xxh3-128 digest of each tensor's copied bytes (GIL released), as a checksummed file
    needs: ``"write"`` in a thread beside the write (a second pass over the buffer, as our writers hash),
    ``"copy"`` by the copy thread right after each tensor is copied (its bytes still in cache)."""

    CHUNK = 16 << 20

    def __init__(
        self, root: str, every: int, hash: Optional[str] = None, offset: int = 0, clock: Optional[StepClock] = None
    ) -> None:
        self.root, self.every, self.hash, self.offset, self.clock = root, every, hash, offset, clock
        self.dsts: List[torch.Tensor] = []
        self.image: Optional[mmap.mmap] = None
        self.copying: Optional[threading.Thread] = None
        self.writing: Optional[threading.Thread] = None
        self.nbytes = 0

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if (trainer.global_step - self.offset) % self.every:
            return
        if self.clock is not None:  # paired with another save in the same fit: its saves are told apart
            self.clock.bare_saves.append(len(self.clock.starts) - 1)
        if self.writing is not None:
            self.writing.join()  # one save in flight, as every row
        tensors = _state_tensors(pl_module, trainer.optimizers[0])
        if self.image is None:
            self.nbytes = sum(t.nbytes for t in tensors)
            self.image = mmap.mmap(-1, -(-self.nbytes // self.CHUNK) * self.CHUNK)
            self.image.write(b"\0" * len(self.image))  # touched once: later saves reuse it
        flat = torch.frombuffer(self.image, dtype=torch.uint8)
        dsts, at = [], 0
        for t in tensors:
            dsts.append(flat[at : at + t.nbytes].view(t.dtype).view(t.shape))
            at += t.nbytes

        self.dsts = dsts

        def copy() -> None:
            with torch.no_grad():
                for dst, src in zip(dsts, tensors):
                    dst.copy_(src)
                    if self.hash == "copy":
                        xxhash.xxh3_128_hexdigest(_bytes(dst))

        self.copying = threading.Thread(target=copy)
        self.copying.start()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.copying is None:
            return
        self.copying.join()  # the barrier
        self.copying = None
        self.writing = threading.Thread(target=self._write, args=(os.path.join(self.root, "bare.bin"),))
        self.writing.start()

    def _write(self, path: str) -> None:
        assert self.image is not None
        hasher = None
        if self.hash == "write":
            hasher = threading.Thread(target=lambda: [xxhash.xxh3_128_hexdigest(_bytes(d)) for d in self.dsts])
            hasher.start()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
        try:
            view = memoryview(self.image)
            for at in range(0, len(self.image), self.CHUNK):
                os.write(fd, view[at : at + self.CHUNK])
            os.fsync(fd)
        finally:
            os.close(fd)
            if hasher is not None:
                hasher.join()

    def in_flight(self) -> bool:
        return self.copying is not None or (self.writing is not None and self.writing.is_alive())

    def on_train_end(self, *args) -> None:
        if self.writing is not None:
            self.writing.join()


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


def _state_tensors(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> List[torch.Tensor]:
    """Every weight and optimizer tensor: the bytes a save of the state copies."""
    tensors = [p.detach() for p in model.parameters()]
    if optimizer is None:
        return tensors
    return tensors + [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


@dataclass(frozen=True)
class Config:
    io: Optional[Callable[[], Any]]
    """The CheckpointIO plugin (with a ``ModelCheckpoint``), or ``None``: none (a DCP callback, or no saves)."""
    exact: bool = True
    dcp: Optional[AsyncCheckpointerType] = None
    bare: bool = False
    """Add ``BareCopyWrite`` (the machine's limit), saving at the same steps as the ``ModelCheckpoint``."""
    bare_hash: Optional[str] = None
    """``BareCopyWrite(hash=...)``: where the limit hashes (``None``: it does not)."""
    paired: bool = False
    """One fit, two saves taking turns: the ``ModelCheckpoint`` with ``io`` every ``2 * every`` steps, and the
    machine limit (``BareCopyWrite``) at the steps halfway between, so both are judged against the same calm
    steps of the same process (a fit's speed drifts by more than the difference between two saves)."""


def _in_flight(trainer: pl.Trainer) -> bool:
    io = trainer.strategy.checkpoint_io
    other = next((c for c in trainer.callbacks if isinstance(c, (DcpEvery, BareCopyWrite))), None)  # type: ignore[attr-defined]
    if other is not None and other.in_flight():
        return True
    if isinstance(io, SafetensorsCheckpointIO):
        return io.write_in_flight()
    if isinstance(io, CountedAsyncIO):
        return io.counted.pending > 0
    return False


CONFIGS: Dict[str, Config] = {
    "ExactResume + SafetensorsCheckpointIO(save='overlapped')": Config(
        lambda: SafetensorsCheckpointIO(save="overlapped")
    ),
    "ExactResume + SafetensorsCheckpointIO(save='overlapped', writer='process')": Config(
        lambda: SafetensorsCheckpointIO(save="overlapped", writer="process")
    ),
    "ExactResume + SafetensorsCheckpointIO(save='async')": Config(lambda: SafetensorsCheckpointIO(save="async")),
    "ExactResume + SafetensorsCheckpointIO(save='async', writer='process')": Config(
        lambda: SafetensorsCheckpointIO(save="async", writer="process")
    ),
    "ExactResume + SafetensorsCheckpointIO(save='sync')": Config(lambda: SafetensorsCheckpointIO(save="sync")),
    "ExactResume + SafetensorsCheckpointIO(save='sync', writer='process')": Config(
        lambda: SafetensorsCheckpointIO(save="sync", writer="process")
    ),
    "SafetensorsCheckpointIO(save='overlapped'), no ExactResume": Config(
        lambda: SafetensorsCheckpointIO(save="overlapped"), exact=False
    ),
    "ExactResume + Lightning AsyncCheckpointIO": Config(CountedAsyncIO),
    "ExactResume + Lightning TorchCheckpointIO (default)": Config(TorchCheckpointIO),
    "dcp.async_save, thread staging (callback, no ExactResume)": Config(None, False, AsyncCheckpointerType.THREAD),
    "dcp.async_save, process staging (callback, no ExactResume)": Config(None, False, AsyncCheckpointerType.PROCESS),
    PAIRED: Config(lambda: SafetensorsCheckpointIO(save="overlapped"), paired=True),
    BARE: Config(NullCheckpointIO, bare=True),
    BARE + ", + xxh3 beside the write": Config(NullCheckpointIO, bare=True, bare_hash="write"),
    BARE + ", + xxh3 after each tensor's copy": Config(NullCheckpointIO, bare=True, bare_hash="copy"),
    FLOOR: Config(NullCheckpointIO),
    NONE: Config(None, exact=False),
}


def fit(name: str, root: str, params_mb: int, steps: int, every: int) -> Dict:
    config = CONFIGS[name]
    clock, baseline = StepClock(_in_flight), MemcpyAfterFirstStep()
    callbacks: List[Callback] = [clock, baseline]
    if config.io is not None:
        callbacks.append(
            ModelCheckpoint(dirpath=root, every_n_train_steps=2 * every if config.paired else every, save_top_k=1)
        )
    if config.bare:
        callbacks.append(BareCopyWrite(root, every, config.bare_hash))
    if config.paired:
        callbacks.append(BareCopyWrite(root, 2 * every, offset=every, clock=clock))
    if config.dcp is not None:
        if config.dcp == AsyncCheckpointerType.PROCESS:
            _one_rank_group()
        callbacks.append(DcpEvery(root, every, config.dcp, clock))
    timed = TimedExactResume(mtbf=None, preemption=None)
    if config.exact:
        callbacks.insert(0, timed)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks,
        plugins=[config.io()] if config.io is not None else None, logger=False, enable_checkpointing=config.io is not None,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=root,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer.fit(Wide(params_mb))
    trainer.strategy.checkpoint_io.teardown()
    return {
        "starts": clock.starts,
        "in_flight": clock.in_flight,
        "saves": clock.saves,
        "bare_saves": clock.bare_saves,
        "memcpy": baseline.seconds,
        "exact": timed.seconds[1:],
    }


def _one_rank_group() -> None:
    """A gloo process group of this process alone: DCP's process staging asks the group for its rank."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def windows(saves: List[int], flight: List[bool], n: int, window: int) -> List[range]:
    """Each save's window (``saves``: the batches that saved, ascending; ``n`` steps with a measured time): its
    step and the next ``window - 1``, longer while a write is in flight, never past the next save's step."""
    out = []
    for k, s in enumerate(saves):
        end = min(s + window, n)
        stop = saves[k + 1] if k + 1 < len(saves) else n
        while end < stop and flight[end]:
            end += 1
        out.append(range(s, min(end, stop)))
    return out


def analyse(run: Dict, window: int, every: int) -> Dict[str, Any]:
    """Per save but the first: time lost (seconds; over a memcpy in ``report``); the steps during a write over
    the calm step; each step k after a save over the calm step; steps/s. A paired fit (``Config.paired``) gives
    the same for the machine limit's saves under ``"pair"``, against the same calm step."""
    starts = run["starts"]
    steps = [b - a for a, b in zip(starts, starts[1:])]
    flight = run["in_flight"][: len(steps)]
    spans = windows(sorted(run["saves"] + run["bare_saves"]), flight, len(steps), window)
    disturbed = {i for w in spans for i in w} | {i for i, f in enumerate(flight) if f}
    calm = statistics.median(t for i, t in enumerate(steps) if i not in disturbed and i > 0)
    by_start = {w.start: w for w in spans}

    def per_save(saves: List[int]) -> Dict[str, Any]:
        mine = [by_start[s] for s in saves[1:]]  # the first save of each kind allocates its staging
        return {
            "lost": [sum(steps[i] - calm for i in w) for w in mine],
            "during": [steps[i] / calm for w in mine for i in w if flight[i] and i != w.start],
            "after": [[steps[s + k] / calm for s in saves[1:] if s + k < len(steps)] for k in range(window + 2)],
        }

    first, last = 2 * every - 1, (len(starts) - 1) // every * every - 1  # whole save periods: second save to last
    rate = (last - first) / (starts[last] - starts[first]) if last > first else float("nan")
    out = {"rate": rate, "memcpy": run["memcpy"], "exact": run["exact"], **per_save(run["saves"])}
    if run["bare_saves"]:
        out["pair"] = per_save(run["bare_saves"])
    return out


def _child(args: argparse.Namespace) -> None:
    run = fit(args.child, args.root, args.params_mb, args.steps, args.every)
    print("RESULT " + json.dumps(run))


def _spawn(name: str, root: str, a: argparse.Namespace) -> Dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--root", root]
    cmd += ["--params-mb", str(a.params_mb), "--steps", str(a.steps), "--every", str(a.every)]
    return child_result(cmd, repr(name))


def child_result(cmd: List[str], what: str) -> Dict:
    """Run the fit ``cmd`` in a fresh process; the JSON of its ``RESULT `` line (``RuntimeError`` naming ``what``
    and the end of its stderr when it fails or prints none)."""
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"fit {what} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(line[len("RESULT ") :])


def _med(v: List[float], fmt: str = "{:.2f}") -> str:
    if not v:
        return "-"
    return (fmt + "x (" + fmt + "-" + fmt + ")").format(statistics.median(v), min(v), max(v))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params-mb", type=int, default=64)
    p.add_argument("--steps", type=int, default=61)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--only", default=None, help="run only the configurations whose name contains this (and floor, limit, none)"
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--root", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is not None:
        _child(a)
        return
    names = [n for n in CONFIGS if a.only is None or a.only in n or n in (FLOOR, NONE, BARE)]
    got: Dict[str, List[Dict[str, Any]]] = {n: [] for n in names}
    loads = [os.getloadavg()]
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
        for r in range(a.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                run = _spawn(name, os.path.join(root, f"{r}-{names.index(name)}"), a)
                got[name].append(analyse(run, a.window, a.every))
                loads.append(os.getloadavg())
                print(f"fit {r + 1}/{a.repeats} {name}: done, load {loads[-1][0]:.2f}", file=sys.stderr, flush=True)
    report(got, a, loads)


def report(got: Dict[str, List[Dict[str, Any]]], a: argparse.Namespace, loads: List[Any]) -> None:
    got = _with_pairs(got)
    state_mb = 3 * a.params_mb
    floor = statistics.median(x["rate"] for x in got[FLOOR]) if FLOOR in got else float("nan")
    # One memcpy for every row: the median over all fits of the run (each fit's own swung 0.05-0.09 s here,
    # which moved its ratios by as much; the state is the same in every fit).
    memcpy_all = statistics.median(x["memcpy"] for runs in got.values() for x in runs)
    one = [x[0] for x in loads]
    print(
        f"state ~{state_mb} MB (weights {a.params_mb} MB + AdamW moments), save every {a.every} steps, {a.steps} steps,"
    )
    print(f"{a.repeats} fits per row; load average (1 min) {min(one):.2f}-{max(one):.2f} during the run")
    print(f"time lost per save over one memcpy of the state for every row: {memcpy_all:.3f} s (median of all fits)")
    print("| configuration | time lost per save / memcpy | step during a write / calm step | steps/s vs floor"
          " | ExactResume.state_dict / memcpy | saves | memcpy (s) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, runs in got.items():
        lost = [v / memcpy_all for x in runs for v in x["lost"]]
        during = [v for x in runs for v in x["during"]]
        rates = [x["rate"] / floor for x in runs]
        exact = [t / memcpy_all for x in runs for t in x["exact"]]
        memcpy = statistics.median(x["memcpy"] for x in runs)
        cells = [
            _med(lost) if name != NONE else "-",
            _med(during, "{:.3f}"),
            _med(rates, "{:.3f}"),
            _med(exact, "{:.3f}"),
            str(len(lost)),
            f"{memcpy:.3f}",
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(
        "\nStep k after a save (k = 0: the step that saved) over the calm step, median over the saves (first left out):"
    )
    k_max = a.window + 2
    print("| configuration | " + " | ".join(f"k={k}" for k in range(k_max)) + " |")
    print("|---|" + "---:|" * k_max)
    for name, runs in got.items():
        if name == NONE:
            continue
        cols = [[v for x in runs for v in x["after"][k]] for k in range(k_max)]
        print(f"| {name} | " + " | ".join(f"{statistics.median(c):.3f}" if c else "-" for c in cols) + " |")
    _paired_differences(got, memcpy_all)


PAIRED_LIMIT = " -> its paired machine limit (same fits)"


def _with_pairs(got: Dict[str, List[Dict[str, Any]]]) -> Dict[str, List[Dict[str, Any]]]:
    """``got`` with a row after each paired configuration for the machine limit's saves in the same fits."""
    out: Dict[str, List[Dict[str, Any]]] = {}
    for name, runs in got.items():
        out[name] = runs
        if runs and "pair" in runs[0]:
            out[name + PAIRED_LIMIT] = [
                {**x["pair"], "rate": x["rate"], "memcpy": x["memcpy"], "exact": []} for x in runs
            ]
    return out


def _paired_differences(got: Dict[str, List[Dict[str, Any]]], memcpy_all: float) -> None:
    """Per paired configuration, each fit's median time lost per save minus its machine limit's (same fit)."""
    for name, runs in got.items():
        limit = got.get(name + PAIRED_LIMIT)
        if not limit:
            continue
        diffs = [
            (statistics.median(x["lost"]) - statistics.median(y["lost"])) / memcpy_all
            for x, y in zip(runs, limit)
            if x["lost"] and y["lost"]
        ]
        print(
            f"\n{name}: time lost per save minus the paired limit's, per fit (/ memcpy): "
            + ", ".join(f"{d:+.2f}x" for d in diffs)
        )


if __name__ == "__main__":
    main()
