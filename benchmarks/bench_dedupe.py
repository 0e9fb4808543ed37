"""Content-addressed saves (``SafetensorsCheckpointIO(dedupe=True)``) against today's full save, in a Lightning fit.

Each fit runs ``Trainer.fit`` as users run it (``ExactResume`` + a checkpoint callback + the plugin, CPU, one
thread) in a fresh process of its own; the two plugins, ``dedupe=False`` (today, the default) and
``dedupe=True``, alternate within each scenario and each repeat, so both are measured in the same run:

- ``lora``: a Hugging Face ``transformers`` ``LlamaForCausalLM`` built from a ``LlamaConfig`` (the library's
  defaults but the size; random init, nothing downloaded: ``HF_HUB_OFFLINE=1``), its base frozen, with
  hand-written low-rank adapters on the attention's ``q_proj`` and ``v_proj`` (as public LoRA examples write
  them: ``A`` Kaiming-uniform, ``B`` zero, ``scale = alpha / r``), AdamW over the adapters. Saved by
  ``RetentionCheckpoint(retention=RetentionPolicy(keep_last=3, keep_best=2, anchor_every_n_steps=...))``
  ranking a logged training loss: per save, the bytes written and the time; at the end, the disk the kept set
  uses (``keep_last=3, keep_best=2`` plus anchors).
- ``full``: the same Llama, every parameter trained (AdamW), so every tensor changes between saves; saved by
  ``ModelCheckpoint(save_top_k=1)``: time per save (goal: at most 1.05x today's) and bytes (goal: 1.0x).
- ``embedding``: an ``nn.Embedding`` table trained by SGD without momentum on a few rows per step (the others
  keep their bits), saved by ``ModelCheckpoint(save_top_k=1)``: what per-tensor keys write, and what
  fixed-size blocks of the table would have written (the share of blocks of each size whose bytes changed
  since the previous save, compared in memory at each save: a copy and a comparison of the table that its
  "time lost per save" includes; its ``save_checkpoint`` time does not).

Bytes written by a save: the sizes of the files in the checkpoint directory, ``blocks/`` included, that are
new after the save returned (a path with a new inode or mtime: an atomic rename is a new file). Full state:
the bytes of every tensor the checkpoint holds (the weights and the optimizer state); the trainable share:
the trainable parameters plus their optimizer state. Time per save: the plugin's ``save_checkpoint`` call
(``save="sync"``: the training thread waits for the durable file), and, from the step clock of
``bench_save_in_fit`` (``StepClock``, ``analyse``), the time a save cost the fit's steps over the calm step.
The first save of each fit is left out of the times (its buffers are new); its bytes are given apart (a
first save writes everything). Medians and ranges over the saves of ``--repeats`` fits.

Usage: ``python benchmarks/bench_dedupe.py --repeats 2`` (a Llama of ~470 MB of weights: hidden 1024,
intermediate 2816, 4 layers, the default 32 heads and 32000-token vocabulary); ``--only lora`` runs one
scenario (``--only full,embedding`` two); ``--quick`` a tiny run of every scenario in seconds, every fit in
this process (its times mean nothing; its bytes are what a tiny model's are); ``--breakdown`` where a full
fine-tune's save goes, outside a fit (``BENCH_DIR=/dev/shm`` takes the disk out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from benchmarks.bench_save_in_fit import StepClock, analyse, child_result  # noqa: E402
from lightning_resume import ExactResume, RetentionCheckpoint, RetentionPolicy, SafetensorsCheckpointIO  # noqa: E402

SCENARIOS = ("lora", "full", "embedding")
TODAY, DEDUPE = "dedupe=False (today)", "dedupe=True"
PLUGINS = {TODAY: False, DEDUPE: True}
BLOCK_SIZES = (64 << 10, 1 << 20, 4 << 20)
"""Fixed block sizes the embedding scenario prices (bytes)."""


@dataclass(frozen=True)
class Size:
    """The model sizes and the fit's length: ``--quick`` shrinks every one."""

    hidden: int = 1024
    intermediate: int = 2816
    layers: int = 4
    heads: int = 32
    vocab: int = 32000
    seq: int = 32
    rank: int = 8
    rows: int = 262144
    dim: int = 128
    steps: int = 41
    every: int = 5
    anchor_every: int = 15


QUICK = Size(hidden=128, intermediate=352, layers=2, heads=4, vocab=2000, rows=8192, dim=32, steps=13, every=3,
             anchor_every=5)  # fmt: skip
"""Each projection 64 KiB: at least ``MIN_BLOCK_BYTES``, so that it is referenced, not kept inline."""


# ---- the models, as users write them ------------------------------------------------------------------


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update ``B @ A`` scaled by ``alpha / r`` (LoRA, Hu et
    al. 2021, written the way its reference implementation ``loralib.Linear`` writes it)."""

    def __init__(self, base: nn.Linear, r: int = 8, alpha: int = 16) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(base.weight.new_zeros(r, base.in_features))
        self.lora_B = nn.Parameter(base.weight.new_zeros(base.out_features, r))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scaling


def add_lora(model: nn.Module, r: int, targets: Tuple[str, ...] = ("q_proj", "v_proj")) -> None:
    """Freeze every parameter of ``model``, then wrap each attention projection named in ``targets``."""
    model.requires_grad_(False)
    for module in list(model.modules()):
        for name in targets:
            child = getattr(module, name, None)
            if isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, r))


class Llama(pl.LightningModule):
    """A randomly initialised ``LlamaForCausalLM`` trained on random tokens (its own loss), LoRA or full."""

    def __init__(self, size: Size, lora: bool) -> None:
        super().__init__()
        config = LlamaConfig(
            vocab_size=size.vocab,
            hidden_size=size.hidden,
            intermediate_size=size.intermediate,
            num_hidden_layers=size.layers,
            num_attention_heads=size.heads,
        )
        self.net = LlamaForCausalLM(config)
        if lora:
            add_lora(self.net, size.rank)
        self.size = size

    def training_step(self, batch, _):
        (ids,) = batch
        loss = self.net(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        ids = torch.randint(0, self.size.vocab, (4 * self.size.steps, self.size.seq))
        return DataLoader(TensorDataset(ids), batch_size=2)


class Rows(pl.LightningModule):
    """An embedding table and a linear head; each step looks up 32 random rows and trains them by SGD (no
    momentum): only those rows change."""

    def __init__(self, size: Size) -> None:
        super().__init__()
        self.table = nn.Embedding(size.rows, size.dim)
        self.head = nn.Linear(size.dim, 1)
        self.size = size

    def training_step(self, batch, _):
        (ids,) = batch
        return self.head(self.table(ids)).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randint(0, self.size.rows, (32 * self.size.steps,))), batch_size=32)


# ---- measuring ---------------------------------------------------------------------------------------


def listing(root: str) -> Dict[str, Tuple[int, int, int]]:
    """Every file under ``root``: its path -> (inode, mtime in ns, size)."""
    out = {}
    for base, _, names in os.walk(root):
        for name in names:
            path = os.path.join(base, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:  # removed while listed
                continue
            out[path] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return out


def new_bytes(before: Dict[str, Tuple[int, int, int]], after: Dict[str, Tuple[int, int, int]]) -> int:
    """The bytes of the files in ``after`` that are not in ``before`` (by path, inode and mtime)."""
    return sum(v[2] for k, v in after.items() if before.get(k, (None, None))[:2] != v[:2])


class MeasuredIO(SafetensorsCheckpointIO):
    """``SafetensorsCheckpointIO`` (``save="sync"``) whose every save is timed and whose new files are counted;
    deletions (and, with ``dedupe``, the collection of unreferenced blocks after them) are timed too."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.saves: List[Dict[str, float]] = []
        self.remove_seconds: List[float] = []

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        root = os.path.dirname(os.path.abspath(str(path)))
        before = listing(root)
        t0 = time.perf_counter()
        super().save_checkpoint(checkpoint, path, storage_options)
        seconds = time.perf_counter() - t0
        self.saves.append({"seconds": seconds, "bytes": new_bytes(before, listing(root))})

    def remove_checkpoint(self, path) -> None:
        t0 = time.perf_counter()
        super().remove_checkpoint(path)
        self.remove_seconds.append(time.perf_counter() - t0)


def tensor_bytes(tree: Any) -> int:
    """The bytes of every tensor in a checkpoint dict."""
    if isinstance(tree, torch.Tensor):
        return tree.nbytes
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


class StateBytes(Callback):
    """At each save: the checkpoint's tensor bytes, and those of the trainable parameters plus their
    optimizer state; with ``table``, the share of each fixed-size block of that weight changed since the
    previous save."""

    def __init__(self, table: Optional[str] = None) -> None:
        self.full: List[int] = []
        self.trainable: List[int] = []
        self.table, self.previous = table, None
        self.changed: Dict[int, List[float]] = {b: [] for b in BLOCK_SIZES}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.full.append(tensor_bytes(checkpoint))
        names = {n for n, p in pl_module.named_parameters() if p.requires_grad}
        weights = sum(t.nbytes for n, t in checkpoint["state_dict"].items() if n in names)
        self.trainable.append(weights + tensor_bytes(checkpoint.get("optimizer_states")))
        if self.table is not None:
            self._blocks(checkpoint["state_dict"][self.table])

    def _blocks(self, weight: torch.Tensor) -> None:
        """One comparison per smallest block; a larger block changed if any of its smallest blocks did."""
        now = weight.detach().flatten().view(torch.uint8).clone()
        if self.previous is not None:
            small = BLOCK_SIZES[0]
            whole = now.numel() // small * small
            changed = (now[:whole] != self.previous[:whole]).view(-1, small).any(dim=1)
            tail = bool((now[whole:] != self.previous[whole:]).any())
            changed = torch.cat([changed, torch.tensor([tail])]) if whole < now.numel() else changed
            for size in BLOCK_SIZES:
                group = size // small
                n = -(-changed.numel() // group)
                grouped = torch.nn.functional.pad(changed, (0, n * group - changed.numel())).view(n, group)
                self.changed[size].append(float(grouped.any(dim=1).sum()) / n)
        self.previous = now


class DiskUsed(Callback):
    """The bytes of every file in ``root`` (``blocks/`` included) at each batch start and at the end: what
    the kept set uses once each save and its deletions are done."""

    def __init__(self, root: str) -> None:
        self.root, self.used = root, []

    def on_train_batch_start(self, *args) -> None:
        self.used.append(sum(v[2] for v in listing(self.root).values()))

    def on_train_end(self, *args) -> None:
        self.on_train_batch_start()


def fit(scenario: str, dedupe: bool, root: str, size: Size) -> Dict[str, Any]:
    """One fit of ``scenario`` with ``SafetensorsCheckpointIO(dedupe=dedupe)`` saving into ``root``."""
    torch.manual_seed(0)
    module: pl.LightningModule = Rows(size) if scenario == "embedding" else Llama(size, lora=scenario == "lora")
    if scenario == "lora":
        policy = RetentionPolicy(keep_last=3, keep_best=2, anchor_every_n_steps=size.anchor_every)
        saver: Callback = RetentionCheckpoint(
            dirpath=root, monitor="train_loss", mode="min", every_n_train_steps=size.every, retention=policy
        )
    else:
        saver = ModelCheckpoint(dirpath=root, every_n_train_steps=size.every, save_top_k=1)
    io = MeasuredIO(**({"dedupe": True} if dedupe else {}))  # dedupe=False is the default: today's save
    clock, state, disk = StepClock(lambda trainer: False), StateBytes("table.weight" if scenario == "embedding" else None), DiskUsed(root)  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=size.steps, plugins=[io], logger=False, max_epochs=-1,
        callbacks=[ExactResume(mtbf=None, preemption=None), clock, state, disk, saver],
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(module)
    io.teardown()
    run = {"starts": clock.starts, "in_flight": clock.in_flight, "saves": clock.saves, "bare_saves": []}
    lost = analyse({**run, "memcpy": None, "exact": []}, window=2, every=size.every)["lost"]
    return {
        "saves": io.saves,
        "remove_seconds": io.remove_seconds,
        "lost": lost,
        "full": state.full,
        "trainable": state.trainable,
        "changed": {str(k): v for k, v in state.changed.items()},
        "disk": disk.used,
        "kept": sorted(os.path.relpath(p, root) for p in listing(root)),
    }


# ---- where a full fine-tune's save goes (``--breakdown``) --------------------------------------------


def breakdown(root: str, size: Size, repeats: int) -> Dict[str, List[float]]:
    """Seconds of one save of the full fine-tune's state (every tensor changed since the save before), outside
    a fit, ``repeats`` times: today's save, a dedupe save predicted changed (written while hashed,
    the steady state), and its parts on the same bytes: the hash pass alone (``integrity.digest`` per tensor,
    one thread), a raw write through the page cache (``os.pwrite``) and the ``fsync`` after it."""
    from lightning_resume.format import integrity

    module = Llama(size, lora=False)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    (ids,) = next(iter(module.train_dataloader()))
    module.net(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    checkpoint = {"state_dict": module.state_dict(), "optimizer_states": [optimizer.state_dict()], "global_step": 1}
    tensors = [t for t in [*checkpoint["state_dict"].values(), *_moments(optimizer)] if t.numel() > 1]
    today, deduped = SafetensorsCheckpointIO(), SafetensorsCheckpointIO(dedupe=True)
    for k in range(2):  # the third dedupe save on predicts "changed": written while hashed
        _change(tensors)
        deduped.save_checkpoint(checkpoint, os.path.join(root, f"warm{k}.ckpt"))
    out: Dict[str, List[float]] = {}
    parts = {
        "today's save (dedupe=False)": lambda i: today.save_checkpoint(checkpoint, os.path.join(root, f"t{i}.ckpt")),
        "dedupe=True save, every tensor changed": lambda i: deduped.save_checkpoint(checkpoint, os.path.join(root, f"d{i}.ckpt")),
        "hash pass alone (xxh3-128, one thread)": lambda i: [integrity.digest("xxh3-128", _bytes(t)) for t in tensors],
        "raw pwrite + fsync": lambda i: _raw_write(os.path.join(root, f"raw{i}"), tensors, out),
    }  # fmt: skip
    saves, others = list(parts.items())[:2], list(parts.items())[2:]
    for i in range(repeats):  # the two saves in alternating order (the second of two big writes runs slower here)
        for name, run in (saves if i % 2 == 0 else saves[::-1]) + others:
            _change(tensors)
            os.sync()
            t0 = time.perf_counter()
            run(i)
            out.setdefault(name, []).append(time.perf_counter() - t0)
        shutil.rmtree(root)  # the packs too: a save predicted "changed" references none
        os.makedirs(root)
    return {name: out[name] for name in [*parts, FSYNC]}


FSYNC = "  of which fsync"


def _moments(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]


def _change(tensors: List[torch.Tensor]) -> None:
    with torch.no_grad():
        for t in tensors:
            t.add_(1e-3)


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().flatten().view(torch.uint8).numpy())


def _raw_write(path: str, tensors: List[torch.Tensor], out: Dict[str, List[float]]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        offset = 0
        for t in tensors:
            view = _bytes(t)
            while view:
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n
        t0 = time.perf_counter()
        os.fsync(fd)
        out.setdefault(FSYNC, []).append(time.perf_counter() - t0)
    finally:
        os.close(fd)


# ---- the run -----------------------------------------------------------------------------------------


def _spawn(scenario: str, plugin: str, root: str) -> Dict[str, Any]:
    """One fit in a fresh process (no thread, pool or page of one fit reaches the next)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", scenario, plugin, root]
    return child_result(cmd, f"{scenario} {plugin!r}")


def _med(v: List[float], fmt: str = "{:.3f}") -> str:
    if not v:
        return "-"
    return (fmt + " (" + fmt + "-" + fmt + ")").format(statistics.median(v), min(v), max(v))


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n < 10e6 else f"{n / 1e6:.0f} MB"


def report(got: Dict[str, Dict[str, List[Dict[str, Any]]]], size: Size, loads: List[Tuple[float, ...]]) -> None:
    one = [x[0] for x in loads]
    print(f"load average (1 min) {min(one):.2f}-{max(one):.2f} during the run; save every {size.every} steps, "
          f"{size.steps} steps per fit")  # fmt: skip
    print("\n| scenario | plugin | full state | trainable + optimizer | first save writes | later saves write "
          "(median, range) | / full state | save_checkpoint (s) | time lost per save (s) | saves |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for scenario, plugins in got.items():
        for plugin, runs in plugins.items():
            full = statistics.median(f for r in runs for f in r["full"])
            trainable = statistics.median(f for r in runs for f in r["trainable"])
            first = statistics.median(r["saves"][0]["bytes"] for r in runs)
            later = [s["bytes"] for r in runs for s in r["saves"][1:]]
            seconds = [s["seconds"] for r in runs for s in r["saves"][1:]]
            lost = [x for r in runs for x in r["lost"]]
            cells = [_mb(full), _mb(trainable), _mb(first), _med([b / 1e6 for b in later], "{:.2f}") + " MB",
                     f"{statistics.median(later) / full:.4f}", _med(seconds), _med(lost), str(len(seconds))]  # fmt: skip
            print(f"| {scenario} | {plugin} | " + " | ".join(cells) + " |")
    _ratios(got)
    _disk(got.get("lora"))
    _blocks(got.get("embedding"))


def _ratios(got: Dict[str, Dict[str, List[Dict[str, Any]]]]) -> None:
    """dedupe=True over today, per scenario: bytes and save time (medians of the later saves; and per repeat)."""
    today, mine = TODAY, DEDUPE
    print("\n| scenario | bytes per save, dedupe / today | save_checkpoint, dedupe / today (per repeat) |")
    print("|---|---:|---:|")
    for scenario, plugins in got.items():
        if today not in plugins or mine not in plugins:
            continue
        a, b = plugins[today], plugins[mine]

        def med(runs, key):
            return statistics.median(s[key] for r in runs for s in r["saves"][1:])

        per = [statistics.median(s["seconds"] for s in y["saves"][1:]) / statistics.median(s["seconds"] for s in x["saves"][1:])
               for x, y in zip(a, b)]  # fmt: skip
        print(f"| {scenario} | {med(b, 'bytes') / med(a, 'bytes'):.4f} | {med(b, 'seconds') / med(a, 'seconds'):.3f} "
              f"({', '.join(f'{p:.3f}' for p in per)}) |")  # fmt: skip


def _disk(plugins: Optional[Dict[str, List[Dict[str, Any]]]]) -> None:
    if not plugins:
        return
    print("\nDisk used by RetentionCheckpoint(keep_last=3, keep_best=2, anchors) at the end of the LoRA fit:")
    print("| plugin | files kept | checkpoints kept | disk at the end | most during the fit |")
    print("|---|---:|---:|---:|---:|")
    for plugin, runs in plugins.items():
        kept = runs[0]["kept"]
        ckpts = sum(1 for k in kept if k.endswith(".ckpt"))
        end = statistics.median(r["disk"][-1] for r in runs)
        peak = max(max(r["disk"]) for r in runs)
        print(f"| {plugin} | {len(kept)} | {ckpts} | {_mb(end)} | {_mb(peak)} |")


def _blocks(plugins: Optional[Dict[str, List[Dict[str, Any]]]]) -> None:
    if not plugins:
        return
    runs = next(iter(plugins.values()))
    print("\nEmbedding table: share of fixed-size blocks changed between consecutive saves (per tensor: 1.0):")
    print("| block size | blocks changed (median, range) |")
    print("|---:|---:|")
    for size in BLOCK_SIZES:
        print(f"| {size >> 10} KiB | " + _med([c for r in runs for c in r["changed"][str(size)]]) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--only", default=None, help=f"comma-separated scenarios to run, of {', '.join(SCENARIOS)}")
    p.add_argument("--quick", action="store_true", help="a tiny run of every scenario (its figures mean nothing)")
    p.add_argument("--breakdown", action="store_true", help="where a full fine-tune's save goes, outside a fit")
    p.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    size = QUICK if a.quick else Size()
    if a.child is not None:
        scenario, plugin, root = a.child
        print("RESULT " + json.dumps(fit(scenario, PLUGINS[plugin], root, size)))
        return
    if a.breakdown:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
            loads = [os.getloadavg()]
            got = breakdown(tmp, size, max(a.repeats, 3))
            loads.append(os.getloadavg())
        print(
            f"load average (1 min) {loads[0][0]:.2f}-{loads[1][0]:.2f}; seconds per save of the full fine-tune's state"
        )
        print("| part | seconds (median, range) | repeats |\n|---|---:|---:|")
        for name, v in got.items():
            print(f"| {name} | {_med(v)} | {len(v)} |")
        today, deduped = list(got.values())[:2]
        paired = [d / t for t, d in zip(today, deduped)]
        first = [statistics.median(paired[k::2]) for k in (0, 1)]  # today first; dedupe first
        print(f"dedupe / today, per repeat (same state, one after the other): {_med(paired)}; "
              + ", ".join(f"{r:.3f}" for r in paired))  # fmt: skip
        print(
            f"median with today first {first[0]:.3f}, with dedupe first {first[1]:.3f}; "
            f"order balanced (their geometric mean): {math.sqrt(first[0] * first[1]):.3f}"
        )
        return
    scenarios = [s for s in SCENARIOS if a.only is None or s in a.only.split(",")]
    got: Dict[str, Dict[str, List[Dict[str, Any]]]] = {s: {p: [] for p in PLUGINS} for s in scenarios}
    loads = [os.getloadavg()]
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        for r in range(a.repeats):
            for scenario in scenarios:
                for plugin in list(PLUGINS)[r % 2 :] + list(PLUGINS)[: r % 2]:
                    root = os.path.join(tmp, f"{r}-{scenario}-{plugin.split()[0]}")
                    if a.quick:  # one process for every fit: its times mean nothing anyway
                        got[scenario][plugin].append(fit(scenario, PLUGINS[plugin], root, size))
                    else:
                        got[scenario][plugin].append(_spawn(scenario, plugin, root))
                    loads.append(os.getloadavg())
                    print(f"fit {r + 1}/{a.repeats} {scenario} {plugin}: done, load {loads[-1][0]:.2f}",
                          file=sys.stderr, flush=True)  # fmt: skip
    report(got, size, loads)


if __name__ == "__main__":
    main()
