"""The CUDA paths on a real GPU, in one unattended command (issue 44): exactness first, then what a save costs.

Sections (``--sections``, comma-separated; all by default, run in the order of ``SECTIONS``: resume, resume_ac,
blocked_small, step, blocked_large, load, so that a run cut short has the most wanted figures):

- ``resume`` / ``resume_ac``: kill-and-resume bit for bit on the accelerator. A small transformer (dropout in
  attention, residual and MLP), ``bf16-mixed``, ``StatefulDataLoader(num_workers=2, shuffle=True)`` over a dataset
  that draws noise from the worker's global RNG, ``ExactResume`` + ``ModelCheckpoint`` every few steps +
  ``SafetensorsCheckpointIO(save="async")``, ``deterministic=True``. Run A goes uninterrupted; run B (a child
  process of its own session) is SIGKILLed with its loader workers mid-epoch, a write possibly in flight; run C
  resumes B's ``"last"`` in a fresh process. Every loss bit of B and C against A, and A's and C's final state:
  weights, AdamW state, step, and every RNG stream (CUDA's included). ``resume_ac`` is the same with
  ``ActivationCheckpointingStrategy(blocks=Block)`` (every block recomputed in backward, dropout with it); its A
  is also compared with ``resume``'s A (checkpointing must not change a bit).
- ``blocked_small`` / ``blocked_large`` (``--small-gb``, ``--large-gb``: the state's bytes, a Linear stack and
  AdamW on the device): per save, the time it costs training, over a pinned device-to-host copy of the same
  bytes into preallocated pinned buffers (the least a snapshot to host memory can cost). Cost = wall time from
  the save's call to the end of the two training steps after it (synchronized) minus two calm steps measured
  just before, so a copy queued on the training stream, or a barrier before the next optimizer step, is
  counted wherever it lands. The step is sized to about twice the pinned copy (a step shorter than the copy
  cannot hide it; printed). Rows: ``SafetensorsCheckpointIO(save="async")`` and ``save="overlapped"``,
  Lightning's ``AsyncCheckpointIO(TorchCheckpointIO())``, and ``torch.distributed.checkpoint.async_save``
  (``no_dist=True``) twice: its default stager, and the overlapped staging it documents (``DefaultStager``:
  pinned, a staging thread and stream; its ``staging_completion`` awaited before the next optimizer step);
  interleaved, each warmed up once; each save's write finishes before the next save. The verdict compares
  ours overlapped with Lightning's and with the better of DCP's two.
- ``step``: the training step while a background write runs, over calm steps (blocks of calm steps and
  write windows alternate); the save's own step, and with ``overlapped`` the step holding the barrier, are
  left out (``blocked_*`` counts them).
- ``load``: a weights file of ``--load-gb`` read into a module on the device: ours with
  ``map_location=<device>``; ours offered the device module for ``load_in_place``; Lightning's
  ``TorchCheckpointIO`` (``torch.load(map_location=...)``) of a ``torch.save`` file; against the floor, a raw
  read of the file's bytes into a pinned buffer plus one host-to-device copy. The page cache is dropped
  before each read where the process may (root); the table says whether it was. Every load is checked bit
  for bit against the weights saved.

Each section is isolated: one that raises is reported ``FAIL`` with its error and the others still run.
``--budget-s`` skips a section whose estimate would run past it (the large state's estimate is scaled from
the small one's measured time); a section still running ``--hang-grace-s`` past the budget is reported hung
(a watchdog prints the table and verdicts and exits 3). ``--out PATH`` writes every result as JSON,
rewritten after each section.
The last line printed is the verdicts. ``--dry-run`` runs the same code on the CPU with tiny sizes and
``bf16-mixed`` (Lightning runs it with CPU autocast), in CI's time: its timings mean nothing; it keeps the
script from rotting (``tests/unit/test_gpu_check.py``).

Usage on a lent GPU: ``python benchmarks/gpu_check.py --out $OUT/gpu.json`` (benchmarks/gpu_check.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_resume import ActivationCheckpointingStrategy, ExactResume, SafetensorsCheckpointIO

SECTIONS = ["resume", "resume_ac", "blocked_small", "step", "blocked_large", "load"]
ESTIMATE_S = {"resume": 75, "resume_ac": 75, "blocked_small": 60, "step": 45, "load": 60, "blocked_large": 240}
"""Seconds each section is expected to take on one H200 (``--budget-s`` skips what would not fit)."""
GB = 1e9

# ------------------------------------------------------------------------------------------ the trainee


class Block(nn.Module):
    """One pre-norm transformer block, attention written out (nanoGPT's manual path): every op deterministic."""

    def __init__(self, dim: int, heads: int, seq: int, p: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.attn_drop, self.resid_drop = nn.Dropout(p), nn.Dropout(p)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(p))
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = self.attn_drop(att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.resid_drop(self.proj(y))
        return x + self.mlp(self.ln2(x))


class Sequences(Dataset):
    """Seeded sequences per index, plus noise from the global torch RNG (the loader worker's stream)."""

    def __init__(self, n: int, seq: int, features: int) -> None:
        self.n, self.seq, self.features = n, seq, features

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.seq, self.features, generator=torch.Generator().manual_seed(i))
        x = x + 0.1 * torch.randn(self.seq, self.features)
        return x, 0.5 * x.roll(1, dims=0)


class TinyGPT(pl.LightningModule):
    def __init__(self, cfg: Dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg
        dim, seq, feats = cfg["dim"], cfg["seq"], cfg["features"]
        self.inp, self.ln, self.head = nn.Linear(feats, dim), nn.LayerNorm(dim), nn.Linear(dim, feats)
        self.blocks = nn.Sequential(*[Block(dim, cfg["heads"], seq, 0.1) for _ in range(cfg["depth"])])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.blocks(self.inp(x))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        data = Sequences(self.cfg["samples"], self.cfg["seq"], self.cfg["features"])
        pin = self.cfg["accelerator"] == "cuda"
        return StatefulDataLoader(data, batch_size=8, shuffle=True, num_workers=2, pin_memory=pin)


class LossLog(Callback):
    """Each step's loss, as the bits of its float32, to ``losses.txt`` (one ``step hex`` line, flushed)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bits = struct.pack("<f", float(outputs["loss"].detach().float()))
        with open(self.path, "a") as f:
            f.write(f"{trainer.global_step} {bits.hex()}\n")


class PauseAt(Callback):
    """At the start of global step ``step``: write ``paused`` and block, for the parent to SIGKILL (a write of
    the checkpoint before may still be in flight: the resume takes the newest that verifies)."""

    def __init__(self, out: Path, step: int) -> None:
        self.out, self.step = out, step

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            (self.out / "paused").write_text(str(self.step))
            while True:
                time.sleep(1)


def final_state(trainer: pl.Trainer, model: nn.Module) -> Dict[str, Any]:
    """Everything a resume must restore, every RNG stream included (CUDA's, per device)."""
    state: Dict[str, Any] = {
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "optimizer": trainer.optimizers[0].state_dict(),
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "torch_rng": torch.get_rng_state(),
        "python_rng": repr(random.getstate()),
        "numpy_rng": [x.tolist() if isinstance(x, np.ndarray) else x for x in np.random.get_state()],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    return state


def train(cfg: Dict[str, Any]) -> None:
    """One run of the trainee (a child process): A, B (with ``pause_at``) or C (with ``resume``)."""
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    pl.seed_everything(0, workers=True)
    callbacks: List[Callback] = [
        ExactResume(mtbf=None),
        ModelCheckpoint(dirpath=cfg["ckpt_dir"], every_n_train_steps=cfg["every"], save_top_k=-1),
        LossLog(out / "losses.txt"),
    ]
    if cfg.get("pause_at") is not None:
        callbacks.append(PauseAt(out, cfg["pause_at"]))
    strategy: Any = ActivationCheckpointingStrategy(blocks=Block, log_plan=False) if cfg["ac"] else "auto"
    trainer = pl.Trainer(
        accelerator=cfg["accelerator"], devices=1, precision=cfg["precision"], strategy=strategy,
        max_epochs=cfg["epochs"], callbacks=callbacks, plugins=[SafetensorsCheckpointIO(save="async")],
        deterministic=True, logger=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=str(out),
    )  # fmt: skip
    model = TinyGPT(cfg)
    trainer.fit(model, ckpt_path=cfg.get("resume"))
    torch.save(final_state(trainer, model), out / "final.pt")
    exact = next(cb for cb in trainer.callbacks if isinstance(cb, ExactResume))  # type: ignore[attr-defined]
    report = exact.resume_report.to_dict()
    plan = getattr(trainer.strategy, "activation_plan", None)
    report["recomputed_blocks"] = list(plan.blocks) if plan is not None else []
    (out / "report.json").write_text(json.dumps(report, default=str))


# ------------------------------------------------------------------------------------------ helpers


@dataclass
class Context:
    device: torch.device
    dry: bool
    root: Path
    args: argparse.Namespace
    results: Dict[str, Any] = field(default_factory=dict)
    current: Optional[str] = None
    """The section running now (the watchdog names it if it hangs)."""

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def bits_equal(a: Any, b: Any, where: str = "") -> List[str]:
    """Where ``a`` and ``b`` differ (tensors bit for bit, dtype and shape; other values by ``==``)."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return [f"{where}: dtype/shape"]
        same = torch.equal(
            a.detach().cpu().reshape(-1).view(torch.uint8), b.detach().cpu().reshape(-1).view(torch.uint8)
        )
        return [] if same else [f"{where}: bits differ"]
    if isinstance(a, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a for d in bits_equal(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in bits_equal(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def median(xs: List[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ------------------------------------------------------------------------------------------ (a) resume


def trainee_config(ctx: Context, ac: bool) -> Dict[str, Any]:
    if ctx.dry:
        sizes = {"dim": 16, "heads": 2, "depth": 2, "seq": 8, "features": 4, "samples": 40, "epochs": 2, "every": 3}
        return {**sizes, "pause_at": 8, "ac": ac, "accelerator": "cpu", "precision": "bf16-mixed"}
    sizes = {"dim": 256, "heads": 8, "depth": 4, "seq": 64, "features": 32, "samples": 192, "epochs": 2, "every": 5}
    return {**sizes, "pause_at": 38, "ac": ac, "accelerator": "cuda", "precision": "bf16-mixed"}


def start_trainee(cfg: Dict[str, Any]) -> subprocess.Popen:
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    cmd = [sys.executable, os.path.abspath(__file__), "--train", str(out / "config.json")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(out / "log.txt", "w") as log:  # the child holds its own descriptor
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def finish(proc: subprocess.Popen, cfg: Dict[str, Any], timeout: float) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = -9
    if rc != 0:
        raise RuntimeError(f"run {cfg['out']} exited {rc}:\n{(Path(cfg['out']) / 'log.txt').read_text()[-3000:]}")


def kill_when_paused(proc: subprocess.Popen, cfg: Dict[str, Any], timeout: float) -> None:
    """SIGKILL the run's whole session (the process and its loader workers) once it wrote ``paused``."""
    marker, end = Path(cfg["out"]) / "paused", time.monotonic() + timeout
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > end:
            finish(proc, cfg, 1)
            raise RuntimeError(f"run {cfg['out']} ended before it paused")
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def losses(cfg: Dict[str, Any]) -> Dict[int, str]:
    text = (Path(cfg["out"]) / "losses.txt").read_text()
    return {int(s): h for s, h in (line.split() for line in text.splitlines() if line.strip())}


def resume_section(ctx: Context, ac: bool) -> Dict[str, Any]:
    root = ctx.root / ("resume_ac" if ac else "resume")
    base = trainee_config(ctx, ac)
    a = {**base, "pause_at": None, "out": str(root / "A"), "ckpt_dir": str(root / "A-ckpt")}
    b = {**base, "out": str(root / "B"), "ckpt_dir": str(root / "BC-ckpt")}
    c = {**base, "pause_at": None, "resume": "last", "out": str(root / "C"), "ckpt_dir": str(root / "BC-ckpt")}
    timeout, started = ctx.args.child_timeout_s, []
    try:
        started += [start_trainee(a), start_trainee(b)]
        kill_when_paused(started[1], b, timeout)
        started.append(start_trainee(c))  # beside A: C needs only B's checkpoints
        finish(started[0], a, timeout)
        finish(started[2], c, timeout)
    finally:  # a failed section leaves no run behind
        for proc in started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    la, lb, lc = losses(a), losses(b), losses(c)
    resumed_from = min(lc) - 1
    problems = [f"B step {s}: {h} != A's {la.get(s)}" for s, h in sorted(lb.items()) if la.get(s) != h]
    problems += [f"C step {s}: {h} != A's {la.get(s)}" for s, h in sorted(lc.items()) if la.get(s) != h]
    if sorted(lc) != [s for s in sorted(la) if s > resumed_from]:
        problems.append(f"C trained steps {min(lc)}-{max(lc)}, A {min(la)}-{max(la)}")
    final = [torch.load(Path(x["out"]) / "final.pt", weights_only=False) for x in (a, c)]
    problems += bits_equal(final[0], final[1], "final")
    report = json.loads((Path(c["out"]) / "report.json").read_text())
    out = {
        "ok": not problems,
        "problems": problems[:20],
        "killed_at_step": base["pause_at"],
        "resumed_from_step": resumed_from,
        "steps_compared": len(lb) + len(lc),
        "final_state_keys": sorted(final[0]),
        "cuda_rng_compared": "cuda_rng" in final[0],
        "resume_report": {k: report.get(k) for k in ("source", "step", "exact", "differences") if k in report},
        "recomputed_blocks": report["recomputed_blocks"],
    }
    if ac and len(report["recomputed_blocks"]) != base["depth"]:
        out["ok"] = False
        out["problems"].append(f"blocks recomputed: {report['recomputed_blocks']}, expected all {base['depth']}")
    if ac and "resume" in ctx.results and ctx.results["resume"].get("losses_a") is not None:
        plain = {int(k): v for k, v in ctx.results["resume"]["losses_a"].items()}
        out["equal_to_no_checkpointing"] = plain == la
    if not ac:
        out["losses_a"] = la
    return out


# ------------------------------------------------------------------------------------------ (b) blocked per save


class LinearState:
    """A stack of square Linear layers and AdamW after one step, on the device: ``nbytes`` of weights and moments."""

    def __init__(self, ctx: Context, nbytes: float, host_copy: bool = True) -> None:
        self.ctx = ctx
        self.width = w = 64 if ctx.dry else 4096
        layers = max(1, round(nbytes / (3 * 4 * w * (w + 1))))
        torch.manual_seed(0)
        self.model = nn.Sequential(*[nn.Linear(w, w, device=ctx.device) for _ in range(layers)])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-6)
        self.rows = 64
        self.x = torch.randn(self.rows, self.width, device=ctx.device)
        self.step()
        self.tensors = list(self.model.state_dict().values())
        self.tensors += [t for s in self.optimizer.state.values() for t in s.values() if t.numel() > 1]
        pin, kept = ctx.cuda, self.tensors if host_copy else []
        self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).zero_() for t in kept]
        self.n = 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def step(self, before_update: Optional[Callable[[], None]] = None) -> float:
        """One synchronized training step; ``before_update`` runs between backward and the optimizer step."""
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=False)
        self.model(self.x).square().mean().backward()
        if before_update is not None:
            before_update()
        self.optimizer.step()
        self.ctx.sync()
        return time.perf_counter() - t0

    def size_step(self, seconds: float, cap_rows: int) -> None:
        """Rows per step so that a step takes about ``seconds`` (at least 64 rows; at most ``cap_rows``, and
        at most what keeps the activations saved for backward under 16 GB)."""
        t = median([self.step() for _ in range(3)])
        cap_rows = min(cap_rows, int(16 * GB / (4 * self.width * len(self.model))))
        rows = int(min(cap_rows, max(64, self.rows * seconds / max(t, 1e-6))))
        self.x = torch.randn(rows, self.width, device=self.ctx.device)
        self.rows = rows
        self.step()

    def memcpy(self) -> float:
        """A device-to-host copy of every tensor into its preallocated (pinned, on CUDA) buffer."""
        self.ctx.sync()
        t0 = time.perf_counter()
        for dst, src in zip(self.host, self.tensors):
            dst.copy_(src, non_blocking=True)
        self.ctx.sync()
        return time.perf_counter() - t0

    def checkpoint(self) -> Dict[str, Any]:
        self.n += 1
        sd = self.model.state_dict()
        return {"state_dict": sd, "optimizer_states": [self.optimizer.state_dict()], "global_step": self.n}


class Saver:
    """One way to save: ``save(checkpoint, path)`` returns once training may go on; ``barrier`` (if any) must run
    before the next optimizer step (a copy still reading the weights); ``wait`` until written."""

    def __init__(
        self,
        name: str,
        save: Callable[[Dict, str], None],
        wait: Callable[[], None],
        barrier: Optional[Callable[[], None]] = None,
        close: Callable[[], None] = lambda: None,
    ) -> None:
        self.name, self.save, self.wait, self.barrier, self.close = name, save, wait, barrier, close


DCP_OVERLAPPED = "torch.distributed.checkpoint.async_save, DefaultStager(async staging, pinned)"


def dcp_savers(ctx: Context) -> List[Saver]:
    """DCP's ``async_save`` as its users run it: the default (staging on the caller), and, where this torch has
    it, the overlapped staging DCP documents (``DefaultStager``: pinned, a staging thread and stream, its
    ``staging_completion`` awaited before the next optimizer step)."""
    pending: List[Any] = []

    def state(ckpt: Dict) -> Dict:
        return {"model": ckpt["state_dict"], "optim": ckpt["optimizer_states"][0]}

    def default(ckpt: Dict, path: str) -> None:
        pending.append(dcp.async_save(state(ckpt), checkpoint_id=path + ".dcp", no_dist=True))

    def wait() -> None:
        while pending:
            got = pending.pop()
            (got.upload_completion if hasattr(got, "upload_completion") else got).result()

    out = [Saver("torch.distributed.checkpoint.async_save (default stager)", default, wait)]
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return out
    options = StagingOptions(
        use_pinned_memory=ctx.cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=ctx.cuda
    )  # shared memory serves DCP's process staging only; ours and this row stage on threads
    stager = DefaultStager(options)
    staged: List[Any] = []

    def overlapped(ckpt: Dict, path: str) -> None:
        got = dcp.async_save(state(ckpt), checkpoint_id=path + ".dcp", no_dist=True, async_stager=stager)
        staged.append(got)
        pending.append(got)

    def barrier() -> None:
        while staged:
            got = staged.pop()
            if hasattr(got, "staging_completion"):
                got.staging_completion.result()

    out.append(Saver(DCP_OVERLAPPED, overlapped, wait, barrier, stager.close))
    return out


def savers(ctx: Context) -> List[Saver]:
    """Ours in both modes (the overlapped one's barrier runs by itself before the next optimizer step:
    torch.optim's global pre-hook), Lightning's async plugin, DCP's ``async_save``."""
    ours = [SafetensorsCheckpointIO(save="async"), SafetensorsCheckpointIO(save="overlapped")]
    lightning = AsyncCheckpointIO(TorchCheckpointIO())
    mine = [
        Saver(f"SafetensorsCheckpointIO(save='{io.save}')", io.save_checkpoint, io.wait, None, io.teardown)
        for io in ours
    ]
    theirs = Saver("Lightning AsyncCheckpointIO(TorchCheckpointIO())", lightning.save_checkpoint, lightning.teardown)
    return [*mine, theirs, *dcp_savers(ctx)]


def clean(root: Path) -> None:
    for p in root.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def blocked_section(ctx: Context, gb: float, repeats: int, deadline: float) -> Dict[str, Any]:
    root = ctx.root / f"blocked-{gb:g}"
    root.mkdir(parents=True, exist_ok=True)
    state = LinearState(ctx, gb * GB)
    memcpy = median([state.memcpy() for _ in range(3)])
    state.size_step(2 * memcpy, cap_rows=256 if ctx.dry else 65536)
    rows: Dict[str, Dict[str, List[float]]] = {}
    all_savers = savers(ctx)
    for s in all_savers:  # warm-up: pools, threads and pinned memory allocated (not counted)
        s.save(state.checkpoint(), str(root / "warm.ckpt"))
        state.step(s.barrier)
        s.wait()
        clean(root)
        rows[s.name] = {"ratio": [], "cost_s": [], "call_s": [], "memcpy_s": []}
    for r in range(repeats):
        if r and time.monotonic() > deadline:
            break
        for s in all_savers[r % len(all_savers) :] + all_savers[: r % len(all_savers)]:
            base = state.memcpy()
            calm = median([state.step() for _ in range(3)])
            ckpt = state.checkpoint()
            t0 = time.perf_counter()
            s.save(ckpt, str(root / f"r{r}.ckpt"))
            call = time.perf_counter() - t0
            state.step(s.barrier)
            state.step()
            cost = time.perf_counter() - t0 - 2 * calm
            del ckpt
            s.wait()
            clean(root)
            row = rows[s.name]
            row["ratio"].append(cost / base)
            row["cost_s"].append(cost)
            row["call_s"].append(call)
            row["memcpy_s"].append(base)
    calm = median([state.step() for _ in range(5)])
    for s in all_savers:
        s.close()
    return {
        "state_bytes": state.nbytes,
        "memcpy_s": memcpy,
        "memcpy_GBps": state.nbytes / memcpy / GB,
        "step_s": calm,
        "step_rows": state.rows,
        "rows": {name: {**v, "median_ratio": median(v["ratio"])} for name, v in rows.items()},
    }


# ------------------------------------------------------------------------------------------ (c) step while writing


def step_section(ctx: Context, gb: float, rounds: int, deadline: float) -> Dict[str, Any]:
    root = ctx.root / "step"
    root.mkdir(parents=True, exist_ok=True)
    state = LinearState(ctx, gb * GB)
    state.size_step(0.002 if ctx.dry else 0.025, cap_rows=256 if ctx.dry else 65536)
    out: Dict[str, Any] = {"state_bytes": state.nbytes, "step_rows": state.rows}
    for mode in ("async", "overlapped"):
        io = SafetensorsCheckpointIO(save=mode)
        io.save_checkpoint(state.checkpoint(), str(root / "warm.ckpt"))
        state.step()
        io.wait()
        skip = 1 if mode == "async" else 2  # the save's step; with overlapped also the step holding the barrier
        ratios, calms, during_n = [], [], 0
        for r in range(rounds):
            if r and time.monotonic() > deadline:
                break
            calm = median([state.step() for _ in range(10)])
            io.save_checkpoint(state.checkpoint(), str(root / f"s{r}.ckpt"))
            during: List[float] = []
            while io.write_in_flight() or len(during) < skip + 3:
                during.append(state.step())
                if len(during) > 5000:
                    break
            io.wait()
            clean(root)
            ratios.append(median(during[skip:]) / calm)
            calms.append(calm)
            during_n += len(during) - skip
        io.teardown()
        out[mode] = {"ratio": ratios, "median_ratio": median(ratios), "calm_s": median(calms), "steps_during": during_n}
    return out


# ------------------------------------------------------------------------------------------ (d) load


def drop_caches(dry: bool) -> bool:
    """Drop the page cache (root only), so that a load reads the disk; not in a dry run (a shared machine)."""
    if dry:
        return False
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def load_section(ctx: Context, gb: float, repeats: int, deadline: float) -> Dict[str, Any]:
    root = ctx.root / "load"
    root.mkdir(parents=True, exist_ok=True)
    state = LinearState(ctx, gb * GB * 3, host_copy=False)  # weights are a third of the state: ``gb`` of them
    source = {k: v.detach().clone() for k, v in state.model.state_dict().items()}
    ours_path, torch_path = str(root / "w.ckpt"), str(root / "w.pt")
    SafetensorsCheckpointIO().save_checkpoint({"state_dict": source}, ours_path)
    TorchCheckpointIO().save_checkpoint({"state_dict": source}, torch_path)
    nbytes = os.path.getsize(ours_path)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=ctx.cuda)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    target = state.model
    io = SafetensorsCheckpointIO()

    def raw() -> None:
        view, at = memoryview(host.numpy()), 0
        with open(ours_path, "rb", buffering=0) as f:
            while at < nbytes:  # one read returns at most ~2 GiB on Linux
                at += f.readinto(view[at:]) or nbytes
        dev.copy_(host, non_blocking=True)

    def ours_map() -> None:
        target.load_state_dict(io.load_checkpoint(ours_path, map_location=ctx.device)["state_dict"])

    def ours_in_place() -> None:
        io.load_into(target)
        target.load_state_dict(io.load_checkpoint(ours_path)["state_dict"])

    def lightning_map() -> None:
        target.load_state_dict(TorchCheckpointIO().load_checkpoint(torch_path, map_location=ctx.device)["state_dict"])

    ways = {
        "raw read + one H2D copy (floor)": raw,
        "SafetensorsCheckpointIO, map_location=device": ours_map,
        "SafetensorsCheckpointIO, load_in_place (device module offered)": ours_in_place,
        "Lightning TorchCheckpointIO, map_location=device": lightning_map,
    }
    times: Dict[str, List[float]] = {k: [] for k in ways}
    problems: List[str] = []
    cold = []
    for r in range(repeats):
        if r and time.monotonic() > deadline:
            break
        for name, fn in ways.items():
            with torch.no_grad():
                for p in target.parameters():
                    p.zero_()
            cold.append(drop_caches(ctx.dry))
            ctx.sync()
            t0 = time.perf_counter()
            fn()
            ctx.sync()
            times[name].append(time.perf_counter() - t0)
            if name != "raw read + one H2D copy (floor)":
                problems += [f"{name}: {d}" for d in bits_equal(source, dict(target.state_dict()), "weights")]
    floor = median(times["raw read + one H2D copy (floor)"])
    return {
        "file_bytes": nbytes,
        "cache_dropped": all(cold),
        "ok": not problems,
        "problems": problems[:10],
        "rows": {k: {"s": v, "median_s": median(v), "ratio": median(v) / floor} for k, v in times.items()},
    }


# ------------------------------------------------------------------------------------------ running and reporting


def run_section(ctx: Context, name: str, deadline: float) -> Dict[str, Any]:
    a, dry = ctx.args, ctx.dry
    if name in ("resume", "resume_ac"):
        return resume_section(ctx, ac=name == "resume_ac")
    if name == "blocked_small":
        return blocked_section(ctx, 0.002 if dry else a.small_gb, a.repeats, deadline)
    if name == "blocked_large":
        return blocked_section(ctx, 0.004 if dry else a.large_gb, max(1, a.repeats - 1), deadline)
    if name == "step":
        return step_section(ctx, 0.004 if dry else a.step_gb, a.repeats, deadline)
    if name == "load":
        return load_section(ctx, 0.002 if dry else a.load_gb, a.repeats, deadline)
    raise ValueError(f"unknown section {name!r}; choose from {', '.join(SECTIONS)}")


def estimate(ctx: Context, name: str) -> float:
    """Seconds ``name`` is expected to take; the large state's from the small one's measured time, by bytes and
    by saves (four warm-ups, then four per round), with a fifth more for margin."""
    if ctx.dry:
        return 0.0
    small, a = ctx.results.get("blocked_small", {}), ctx.args
    if name == "blocked_large" and small.get("status") == "OK":
        saves = (4 + 4 * max(1, a.repeats - 1)) / (4 + 4 * a.repeats)
        return 1.2 * small["seconds"] * a.large_gb / a.small_gb * saves
    return ESTIMATE_S[name]


def run_all(ctx: Context, names: List[str], t_start: float) -> None:
    budget = ctx.args.budget_s
    for name in names:
        spent = time.monotonic() - t_start
        need = estimate(ctx, name)
        if spent + need > budget:
            ctx.results[name] = {
                "status": "SKIPPED",
                "reason": f"{spent:.0f} s spent + ~{need:.0f} s > budget {budget} s",
            }
        else:
            t0 = time.monotonic()
            ctx.current = name
            deadline = t_start + budget - 5
            try:
                ctx.results[name] = {"status": "OK", **run_section(ctx, name, deadline)}
            except BaseException as err:  # one section's failure must not lose the others
                if isinstance(err, KeyboardInterrupt):
                    raise
                ctx.results[name] = {"status": "FAIL", "error": f"{type(err).__name__}: {err}"[:3000]}
                ctx.results[name]["traceback"] = traceback.format_exc()[-3000:]
            ctx.results[name]["seconds"] = time.monotonic() - t0
            ctx.current = None
            if ctx.results[name]["status"] == "OK" and ctx.results[name].get("ok") is False:
                ctx.results[name]["status"] = "FAIL"
        print(f"[{time.monotonic() - t_start:6.1f} s] {name}: {ctx.results[name]['status']}", flush=True)
        write_json(ctx)


def start_watchdog(ctx: Context, seconds: float) -> threading.Timer:
    """After ``seconds``, a section still running is taken as hung: it is reported ``FAIL``, the table, the
    verdicts and the JSON are written, and the process exits 3 (a hung CUDA call cannot be interrupted)."""

    def fire() -> None:
        if ctx.current is not None:
            ctx.results[ctx.current] = {"status": "FAIL", "error": f"still running after {seconds:.0f} s (watchdog)"}
        report(ctx)
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def report(ctx: Context) -> None:
    ctx.results.get("resume", {}).pop("losses_a", None)
    write_json(ctx)
    print("\n".join(table(ctx)))
    print(verdicts(ctx), flush=True)


def write_json(ctx: Context) -> None:
    if ctx.args.out:
        Path(ctx.args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ctx.args.out).write_text(
            json.dumps({"machine": machine(ctx), "sections": ctx.results}, indent=1, default=str)
        )


def machine(ctx: Context) -> Dict[str, Any]:
    info: Dict[str, Any] = {"torch": torch.__version__, "lightning": pl.__version__, "dry_run": ctx.dry}
    info["device"] = torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu"
    info["precision"] = "bf16-mixed"
    info["cpus"] = os.cpu_count()
    info["checkpoint_dir_fs"] = filesystem(ctx.root)
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        info["gpu_memory_GB"] = round(props.total_memory / GB, 1)
        info["cuda"] = torch.version.cuda
    info["date_utc"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    return info


def filesystem(path: Path) -> str:
    """The type of the filesystem ``path`` is on (``/proc/mounts``' longest matching mount point)."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "unknown"
    here = str(path.resolve())
    best = max((m for m in mounts if here == m[0] or here.startswith(m[0].rstrip("/") + "/")), key=lambda m: len(m[0]))
    return f"{best[1]} at {best[0]}"


def table(ctx: Context) -> List[str]:
    lines = [f"machine: {json.dumps(machine(ctx))}", "| section | row | figure |", "|---|---|---|"]
    for name, res in ctx.results.items():
        if res["status"] != "OK":
            problems = res.get("problems") or []
            said = res.get("error") or res.get("reason") or f"{len(problems)} differences, first: {problems[:3]}"
            lines.append(f"| {name} | {res['status']} | {said} |")
            continue
        if name.startswith("resume"):
            fig = f"bitwise OK: {res['steps_compared']} losses, final state incl. CUDA RNG={res['cuda_rng_compared']}"
            fig += f"; killed at {res['killed_at_step']}, resumed from {res['resumed_from_step']}"
            if "equal_to_no_checkpointing" in res:
                fig += f"; losses equal to no checkpointing: {res['equal_to_no_checkpointing']}"
            lines.append(f"| {name} | kill-and-resume | {fig} |")
        elif name.startswith("blocked"):
            head = f"state {res['state_bytes'] / GB:.3f} GB, pinned copy {res['memcpy_s'] * 1e3:.1f} ms"
            head += f" ({res['memcpy_GBps']:.1f} GB/s), step {res['step_s'] * 1e3:.1f} ms"
            lines.append(f"| {name} | (baseline) | {head} |")
            for row, v in res["rows"].items():
                cost, call = median(v["cost_s"]) * 1e3, median(v["call_s"]) * 1e3
                fig = f"cost {v['median_ratio']:.3f}x the pinned copy ({cost:.1f} ms; call returns in {call:.1f} ms)"
                lines.append(f"| {name} | {row} | {fig} |")
        elif name == "step":
            for mode in ("async", "overlapped"):
                v = res[mode]
                fig = f"step while writing {v['median_ratio']:.3f}x calm ({v['calm_s'] * 1e3:.1f} ms; {v['steps_during']} steps)"
                lines.append(f"| step | save='{mode}' | {fig} |")
        elif name == "load":
            cache = "page cache dropped" if res["cache_dropped"] else "page cache warm"
            for row, v in res["rows"].items():
                lines.append(f"| load | {row} | {v['median_s'] * 1e3:.1f} ms, {v['ratio']:.2f}x floor ({cache}) |")
    return lines


def verdicts(ctx: Context) -> str:
    r = ctx.results

    def status(name: str) -> str:
        return r.get(name, {}).get("status", "NOT-RUN")

    parts = [f"bitwise={status('resume')}", f"bitwise_ac={status('resume_ac')}"]
    for name in ("blocked_small", "blocked_large"):
        if status(name) != "OK":
            parts.append(f"{name}={status(name)}")
            continue
        rows = {k: v["median_ratio"] for k, v in r[name]["rows"].items()}
        over = rows["SafetensorsCheckpointIO(save='overlapped')"]
        light = rows["Lightning AsyncCheckpointIO(TorchCheckpointIO())"]
        dcp_ = min(v for k, v in rows.items() if k.startswith("torch.distributed.checkpoint"))
        gb = r[name]["state_bytes"] / GB
        parts.append(f"overlapped@{gb:.3g}GB={over:.3f}x({'PASS' if over <= 0.1 else 'MISS'}<=0.1x)")
        parts.append(f"<lightning({light:.3f}x)={'PASS' if over < light else 'MISS'}")
        parts.append(f"<dcp_best({dcp_:.3f}x)={'PASS' if over < dcp_ else 'MISS'}")
    if status("step") == "OK":
        worst = max(r["step"][m]["median_ratio"] for m in ("async", "overlapped"))
        parts.append(f"step_while_writing={worst:.3f}x({'PASS' if worst <= 1.03 else 'MISS'}<=1.03x)")
    else:
        parts.append(f"step={status('step')}")
    parts.append(f"load={status('load')}")
    failed = [n for n, v in r.items() if v["status"] == "FAIL"]
    parts.append(f"failed={','.join(failed) or 'none'}")
    head = "VERDICT DRY-RUN (cpu, bf16-mixed, tiny sizes: timings mean nothing):" if ctx.dry else "VERDICT:"
    return head + " " + " ".join(parts)


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="the same code on the CPU, tiny sizes (CI)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from: {', '.join(SECTIONS)}")
    p.add_argument("--budget-s", type=float, default=420.0, help="skip a section that would run past this")
    p.add_argument("--out", default=None, help="write the results as JSON here (rewritten after each section)")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    p.add_argument("--small-gb", type=float, default=1.0)
    p.add_argument("--large-gb", type=float, default=10.0)
    p.add_argument("--step-gb", type=float, default=2.0)
    p.add_argument("--load-gb", type=float, default=2.0, help="bytes of weights in the file loaded")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds per section (1 with --dry-run)")
    p.add_argument("--child-timeout-s", type=float, default=150.0, help="longest wait for one training run")
    p.add_argument("--hang-grace-s", type=float, default=60.0, help="past the budget: a running section is hung")
    p.add_argument("--train", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    if args.train:
        train(json.loads(Path(args.train).read_text()))
        return 0
    if args.dry_run:
        args.repeats = 1
    names = [n.strip() for n in args.sections.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise SystemExit(f"--sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --dry-run for the CPU code path")
    t_start = time.monotonic()
    torch.set_num_threads(1 if args.dry_run else min(8, os.cpu_count() or 1))
    device = torch.device("cpu" if args.dry_run else "cuda:0")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="gpu_check-") as tmp:
        ctx = Context(device, args.dry_run, Path(tmp), args)
        watchdog = start_watchdog(ctx, args.budget_s + args.hang_grace_s)
        run_all(ctx, [n for n in SECTIONS if n in names], t_start)
        watchdog.cancel()
    report(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
