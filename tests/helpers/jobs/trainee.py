"""A small, configurable Lightning training run, launched as a subprocess by the exactness tests.

Usage: python trainee.py CONFIG.json. It logs one JSON line per training micro-batch (sample ids and
the float bits of the loss) to ``<out>/steps-rank<R>.jsonl``, writes the final weights and optimizer
state to ``<out>/final.pt``, and, with ``pause_before`` set, blocks at the start of that global
batch index (after the checkpoints before it are written) and writes ``<out>/paused`` so that the
test can SIGKILL it from outside at a known point.
"""

from __future__ import annotations

import functools
import json
import os
import struct
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
from lightning.fabric.plugins.environments import SLURMEnvironment  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, StochasticWeightAveraging  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from lightning.pytorch.utilities import CombinedLoader, rank_zero_only  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler  # noqa: E402

from lightning_resume import (  # noqa: E402
    ExactResume,
    MemoryTierOptions,
    Mirror,
    PreemptionOptions,
    ResumableDataset,
    RetentionCheckpoint,
    RetentionPolicy,
    SafetensorsCheckpointIO,
    ScheduleOptions,
)
from lightning_resume.protocols import AsyncCheckpointWriter  # noqa: E402

if __name__ == "__main__":  # run as a script (also by Lightning's DDP launcher): the repo root holds ``tests``
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.helpers.models import QUIET  # noqa: E402  (after the path is set)

DIM = 8


class Points(Dataset):
    """Deterministic features per index; with ``augment``, noise drawn from the global torch RNG."""

    def __init__(self, n: int, augment: bool) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, DIM, generator=g)
        self.y = (self.x.sum(1, keepdim=True) > 0).float()
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i]
        if self.augment:
            x = x + 0.1 * torch.randn(DIM)
        return {"id": i, "x": x, "y": self.y[i]}


class StatefulPoints(Points):
    """A map-style dataset with its own ``state_dict()`` (it counts the samples it served)."""

    def __init__(self, n: int, augment: bool) -> None:
        super().__init__(n, augment)
        self.served = 0

    def __getitem__(self, i: int):
        self.served += 1
        return super().__getitem__(i)

    def state_dict(self):
        return {"served": self.served}

    def load_state_dict(self, state):
        self.served = state["served"]


class PlainStream(IterableDataset):
    """An iterable with no state anywhere (a generator), as users write them."""

    def __init__(self, n: int, augment: bool) -> None:
        self.points = Points(n, augment)

    def __iter__(self):
        for i in range(len(self.points)):
            yield self.points[i]


class PointIterator:
    """A Stateful iterator over ``points``: its position is ``i``, saved and restored by ``state_dict()``."""

    def __init__(self, points: Points) -> None:
        self.points, self.i = points, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= len(self.points):
            raise StopIteration
        self.i += 1
        return self.points[self.i - 1]

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = state["i"]


class PointStream(IterableDataset):
    """An iterable without ``__len__`` whose position is a Stateful iterator (torchdata protocol)."""

    def __init__(self, n: int, augment: bool) -> None:
        self.points = Points(n, augment)

    def __iter__(self):
        return PointIterator(self.points)


class StatefulStream(PointIterator, IterableDataset):
    """An iterable that is its own Stateful iterator (``__iter__`` starts over and returns ``self``)."""

    def __init__(self, n: int, augment: bool) -> None:
        super().__init__(Points(n, augment))

    def __iter__(self):
        self.i = 0
        return self


DATASETS = {
    "points": Points,
    "stateful": StatefulPoints,
    "stream": PointStream,
    "plain_stream": PlainStream,
    "stateful_stream": StatefulStream,
}


def loss_bits(loss: torch.Tensor) -> str:
    """The float32 bits of a loss, as hex: equal strings are equal losses, bit for bit."""
    return f"{struct.unpack('<I', struct.pack('<f', loss.detach().float().item()))[0]:08x}"


class Model(pl.LightningModule):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.cfg = cfg
        # batchnorm: running statistics DDP keeps per rank (rank 0's are in the checkpoint, the others' are not)
        norm = [nn.BatchNorm1d(32)] if cfg.get("batchnorm") else []
        self.net = nn.Sequential(
            nn.Linear(DIM, 32), *norm, nn.ReLU(), nn.Dropout(cfg.get("dropout", 0.0)), nn.Linear(32, 1)
        )
        if cfg.get("log_metric_object"):  # a torchmetrics metric logged as an object (Lightning keeps an entry for it)
            from torchmetrics import MeanMetric

            self.train_mean = MeanMetric()
        self.log_file = None
        self.automatic_optimization = not cfg.get("manual")  # manual: two optimizers stepped in training_step

    def _record(self, **rec) -> None:
        """One line of ``<out>/steps-rank<R>.jsonl``."""
        if self.log_file is None:
            out = Path(self.cfg["out"])
            self.log_file = open(out / f"steps-rank{self.global_rank}.jsonl", "a", buffering=1)
        self.log_file.write(json.dumps(rec) + "\n")

    def _log_step(self, batch, loss) -> None:
        if self.cfg.get("combined"):  # each loader's ids (None: that loader gave nothing this step)
            ids = {name: None if part is None else [int(i) for i in part["id"]] for name, part in batch.items()}
        else:
            ids = [int(i) for i in batch["id"]]
        rec = dict(epoch=self.current_epoch, step=self.global_step, ids=ids, loss=loss_bits(loss))
        if self.cfg.get("record_lr"):  # the learning rate this step trains with (a float's repr is exact)
            rec["lr"] = [g["lr"] for opt in self.trainer.optimizers for g in opt.param_groups]
        self._record(**rec)

    def _loss(self, batch):
        if not self.cfg.get("combined"):
            return nn.functional.binary_cross_entropy_with_logits(self.net(batch["x"]), batch["y"])
        parts = [p for p in batch.values() if p is not None]
        return sum(nn.functional.binary_cross_entropy_with_logits(self.net(p["x"]), p["y"]) for p in parts)

    def training_step(self, batch, batch_idx):
        if self.cfg.get("slow"):
            time.sleep(self.cfg["slow"])
        loss = self._loss(batch)
        self._log_step(batch, loss)
        if self.cfg.get("log_train_loss"):  # "epoch", "step" or "both": a training metric a scheduler may monitor
            when = self.cfg["log_train_loss"]
            sync = bool(self.cfg.get("sync_dist"))
            self.log("train_loss", loss, on_step=when != "epoch", on_epoch=when != "step", sync_dist=sync)
        if self.cfg.get("log_metric_object"):
            self.train_mean(loss)
            self.log("train_mean", self.train_mean, on_step=False, on_epoch=True)
        if self.cfg.get("log_epoch_extremes"):  # epoch values reduced by max and by sum, not only by mean
            self.log("train_loss_max", loss, on_step=False, on_epoch=True, reduce_fx="max")
            self.log("samples", float(len(batch["id"])), on_step=False, on_epoch=True, reduce_fx="sum")
        if self.cfg.get("manual"):
            first, second = self.optimizers()
            self.manual_backward(loss)
            first.step()
            second.step()
            first.zero_grad()
            second.zero_grad()
        return loss

    def validation_step(self, batch, batch_idx):
        loss = nn.functional.binary_cross_entropy_with_logits(self.net(batch["x"]), batch["y"])
        self.log("val_loss", loss, sync_dist=True)
        if self.cfg.get("record_validation") and not self.trainer.sanity_checking:
            self._log_validation(batch_idx, loss)

    def _log_validation(self, batch_idx, loss) -> None:
        """A validation batch as a step record: the epoch and step user code sees, and the loss bits."""
        self._record(val=batch_idx, epoch=self.current_epoch, step=self.global_step, loss=loss_bits(loss))

    def configure_optimizers(self):
        if self.cfg.get("manual"):  # the first layer and the rest, each its own optimizer
            first = list(self.net[0].parameters())
            rest = [p for p in self.parameters() if all(p is not q for q in first)]
            return torch.optim.AdamW(first, lr=self.cfg.get("lr", 1e-2)), torch.optim.SGD(rest, lr=0.1, momentum=0.9)
        opt = torch.optim.AdamW(self.parameters(), lr=self.cfg.get("lr", 1e-2))
        if not self.cfg.get("scheduler"):
            return opt
        if self.cfg["scheduler"] == "plateau":  # as Lightning's docs write it: the monitor in the scheduler dict
            threshold = self.cfg.get("plateau_threshold", 0.5)  # 0.5: only halving losses count as improving
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=threshold)
            config = {"scheduler": plateau, "monitor": self.cfg.get("monitor", "val_loss")}
            config["interval"] = self.cfg.get("scheduler_interval", "epoch")
            return {"optimizer": opt, "lr_scheduler": config}
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)
        interval = self.cfg.get("scheduler_interval", "step")
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": interval}}

    def _loader(self, dataset, shuffle: bool):
        cfg = self.cfg
        kwargs = dict(batch_size=cfg.get("batch_size", 4), num_workers=cfg.get("num_workers", 0))
        pipeline = cfg.get("pipeline", "recipe")
        if pipeline != "recipe":  # what users already write: no wrapper, Lightning's own DDP sampler
            cls = StatefulDataLoader if pipeline == "stock" else DataLoader
            if isinstance(dataset, IterableDataset):
                return cls(dataset, drop_last=cfg.get("drop_last", False), **kwargs)
            return cls(dataset, shuffle=shuffle, drop_last=cfg.get("drop_last", False), **kwargs)
        if isinstance(dataset, IterableDataset):
            return StatefulDataLoader(dataset, **kwargs)
        if cfg.get("num_workers", 0) > 0:
            dataset = ResumableDataset(dataset)
        if cfg.get("devices", 1) > 1 or cfg.get("distributed_sampler"):
            world, rank = self.trainer.world_size, self.trainer.global_rank
            sampler = StatefulDistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=7)
            return StatefulDataLoader(dataset, sampler=sampler, **kwargs)
        return StatefulDataLoader(dataset, shuffle=shuffle, **kwargs)

    def train_dataloader(self):
        n, augment = self.cfg.get("n", 40), self.cfg.get("augment", False)
        if self.cfg.get("combined"):  # CombinedLoader of two shuffled loaders of unequal lengths
            spec = self.cfg["combined"]
            kind = PointStream if spec.get("iterable") else Points  # iterable: loaders without a length
            loaders = {name: self._loader(kind(size, augment), shuffle=True) for name, size in spec["sizes"].items()}
            return CombinedLoader(loaders, mode=spec["mode"])
        kind = self.cfg.get("dataset", "stream" if self.cfg.get("iterable") else "points")
        ds = DATASETS[kind](n, augment)
        return self._loader(ds, shuffle=self.cfg.get("shuffle", True) and not isinstance(ds, IterableDataset))

    def val_dataloader(self):
        if not self.cfg.get("val_check_interval"):
            return None
        return self._loader(Points(12, augment=self.cfg.get("augment", False)), shuffle=False)


class TemplateModel(Model):
    """A module written as the lightning-hydra-template writes one: the network and a ``functools.partial`` of
    the optimizer are ``__init__`` arguments, stored in every checkpoint by ``save_hyperparameters()``."""

    def __init__(self, cfg: dict, net: nn.Module, optimizer: functools.partial) -> None:
        super().__init__(cfg)
        self.save_hyperparameters(logger=False)
        self.net = net

    def configure_optimizers(self):
        return self.hparams.optimizer(params=self.parameters())


def _model(cfg: dict) -> Model:
    if not cfg.get("template_hparams"):
        return Model(cfg)
    net = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, 1))
    return TemplateModel(cfg, net=net, optimizer=functools.partial(torch.optim.AdamW, lr=cfg.get("lr", 1e-2)))


class PauseBefore(Callback):
    """Blocks at the start of the given global batch index, so the test can kill the process there."""

    def __init__(self, out: Path, batch_index: int) -> None:
        self.out, self.batch_index, self.seen = out, batch_index, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.seen == self.batch_index:
            if isinstance(trainer.strategy.checkpoint_io, AsyncCheckpointWriter):
                trainer.strategy.checkpoint_io.wait()  # the checkpoints before this batch are durable
            if trainer.global_rank == 0:
                (self.out / "paused").write_text(str(trainer.global_step))
            (self.out / f"paused-rank{trainer.global_rank}").write_text(str(trainer.global_step))
            while True:
                time.sleep(1)
        self.seen += 1


class EditWeights(Callback):
    """An EMA-style edit of the weights in place at every batch start: between a save and the next optimizer
    step, so an overlapped snapshot copy must save them as they were at the save (not idempotent: x0.999)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        with torch.no_grad():
            for p in pl_module.parameters():
                p.mul_(0.999)


def _slow_copies(seconds: float) -> None:
    """Every deferred copy of an overlapped snapshot (``overlap_copy``) starts ``seconds`` late on its helper
    thread, so the training thread's next writes come first (the copy-on-write guard must catch them)."""
    import threading

    from lightning_resume.staging import overlap

    copy = overlap._copy_batch

    def slow(dsts, srcs):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(seconds)
        return copy(dsts, srcs)

    overlap._copy_batch = slow


class FlushMemoryTier(Callback):
    """Waits at each batch start until ExactResume's memory-tier write is committed, so that a kill at a
    known point finds the memory snapshot taken before it (its write is otherwise on a worker thread)."""

    def on_train_batch_start(self, trainer, *args):
        for cb in trainer.callbacks:
            store = getattr(getattr(cb, "memory", None), "store", None)
            if isinstance(cb, ExactResume) and store is not None:
                store.wait()


class EpochStartCounter(Callback):
    """A user callback with state set in ``on_train_epoch_start`` that no checkpoint holds."""

    def __init__(self) -> None:
        self.epochs_started = 0

    def on_train_epoch_start(self, trainer, pl_module):
        self.epochs_started += 1


class MetricsRecorder(Logger):
    """Every row Lightning logs, each value as ``float.hex`` (equal strings: equal bits): ``<out>/metrics.jsonl``."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.path = out / "metrics.jsonl"

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_metrics(self, metrics, step=None) -> None:
        row = {"step": step, **{k: float(v).hex() for k, v in sorted(metrics.items())}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def _seed(cfg: dict) -> None:
    if cfg.get("seed_everything", True):
        pl.seed_everything(cfg.get("seed", 0), workers=True)
    else:  # the same start, but no PL_GLOBAL_SEED / PL_SEED_WORKERS for Lightning's samplers and workers
        import random

        import numpy as np

        random.seed(cfg.get("seed", 0))  # A and B start from the same streams, or prove sees two runs at step 0
        np.random.seed(cfg.get("seed", 0))
        torch.manual_seed(cfg.get("seed", 0))


def _retention_checkpoint(ckpt_dir: str, init_args: dict) -> RetentionCheckpoint:
    """``init_args`` as LightningCLI YAML holds them: the groups ``retention`` and ``mirror`` as nested dicts."""
    groups = {"retention": RetentionPolicy, "mirror": Mirror}
    built = {k: groups[k](**v) if k in groups and v is not None else v for k, v in init_args.items()}
    return RetentionCheckpoint(dirpath=ckpt_dir, **built)


def _callbacks(cfg: dict, out: Path) -> list[Callback]:
    ckpt_dir = cfg["ckpt_dir"]
    if cfg.get("ckpt_dir_per_rank"):  # each node its own local directory (Lightning's DDP launcher sets LOCAL_RANK)
        ckpt_dir = f"{ckpt_dir}-rank{os.environ.get('LOCAL_RANK', '0')}"
    if cfg.get("retention") is not None:
        callbacks: list[Callback] = [_retention_checkpoint(ckpt_dir, cfg["retention"])]
    else:
        callbacks = [ModelCheckpoint(dirpath=ckpt_dir, **cfg.get("ckpt", {}))]
    if cfg.get("monitor_ckpt") is not None:  # a second, monitored checkpoint whose file names show epoch and step
        callbacks.append(ModelCheckpoint(dirpath=f"{ckpt_dir}-monitor", **cfg["monitor_ckpt"]))
    if cfg.get("epoch_start_counter"):
        callbacks.append(EpochStartCounter())
    if cfg.get("swa") is not None:
        callbacks.append(StochasticWeightAveraging(**cfg["swa"]))
    if cfg.get("exact", True):
        # No wall-clock snapshots unless a test asks: they would make the step a run resumes from depend
        # on this machine's speed (the default schedule is tested in tests/unit/exact/test_exact_schedule.py).
        exact_args = {"mtbf": None, **cfg.get("exact_args", {})}
        node_memory = os.environ.get("LIGHTNING_RESUME_TEST_NODE_MEMORY")  # tests/helpers/nodes.py: this node's
        if node_memory and isinstance(exact_args.get("memory_tier"), dict):
            exact_args["memory_tier"] = {**exact_args["memory_tier"], "dir": node_memory}
        if cfg.get("notice_endpoints"):  # one metadata server per rank: a notice only one rank sees
            endpoint = cfg["notice_endpoints"][int(os.environ.get("LOCAL_RANK", "0"))]
            exact_args["preemption"] = {**exact_args.get("preemption", {}), "endpoint": endpoint}
        callbacks.insert(0, ExactResume(strict=cfg.get("strict", True), **_groups(exact_args)))
    if cfg.get("flush_memory_tier"):
        callbacks.append(FlushMemoryTier())
    if cfg.get("edit_weights"):
        callbacks.append(EditWeights())
    if cfg.get("pause_before") is not None:
        callbacks.append(PauseBefore(out, cfg["pause_before"]))
    if cfg.get("collective_timeout_s"):
        callbacks.append(CollectiveTimeout(cfg["collective_timeout_s"]))
    return callbacks


def _groups(exact_args: dict) -> dict:
    """``exact_args`` as YAML writes them (``{"schedule": {"every_n_train_steps_max": 3}}``), groups built."""
    groups = {"schedule": ScheduleOptions, "memory_tier": MemoryTierOptions, "preemption": PreemptionOptions}
    return {k: groups[k](**v) if k in groups and isinstance(v, dict) else v for k, v in exact_args.items()}


def _slow_writes(seconds: float) -> None:
    """Every durable write of ``SafetensorsCheckpointIO`` takes ``seconds`` longer (on its worker thread): a
    slow disk or bucket, for the tests of ranks that must not wait on rank 0's I/O inside a collective."""
    from lightning_resume.io import plugin

    commit = plugin.commit_staged

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return commit(*args, **kwargs)

    plugin.commit_staged = slow


class CollectiveTimeout(Callback):
    """Once every rank has joined (a short timeout at the rendezvous would fail a slow start), the process
    group's collectives time out after ``seconds`` (torch's ``_set_pg_timeout``, as gloo and NCCL apply it)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_fit_start(self, trainer, pl_module) -> None:
        torch.distributed.distributed_c10d._set_pg_timeout(timedelta(seconds=self.seconds))


def _trainer(cfg: dict, callbacks: list[Callback]) -> pl.Trainer:
    """The run's trainer; ``record_metrics``: every logged row to ``<out>/metrics.jsonl`` (a row every step)."""
    devices = cfg.get("devices", 1)
    if cfg.get("slow_write"):
        _slow_writes(cfg["slow_write"])
    if cfg.get("slow_copy"):
        _slow_copies(cfg["slow_copy"])
    io_args = {"save": ("overlapped" if cfg.get("overlap_copy") else "async") if cfg.get("async") else "sync"}
    io_args.update(cfg.get("io_args") or {})  # further SafetensorsCheckpointIO options (``dedupe``...)
    plugins: list = [SafetensorsCheckpointIO(**io_args)] if cfg.get("safetensors") else []
    if cfg.get("slurm_auto_requeue") is not None:
        plugins.append(SLURMEnvironment(auto_requeue=cfg["slurm_auto_requeue"]))
    logging = {"logger": MetricsRecorder(Path(cfg["out"])), "log_every_n_steps": 1} if cfg.get("record_metrics") else {}
    return pl.Trainer(
        **{**QUIET, **logging},
        plugins=plugins,
        accelerator="cpu",
        devices=devices,
        num_nodes=cfg.get("num_nodes", 1),  # torchrun's --nnodes (tests/helpers/nodes.py)
        # ``ddp`` (DDPStrategy's kwargs) also on one device: a one-process DDP run, as torchrun launches it
        strategy=(DDPStrategy(**cfg.get("ddp") or {}) if devices > 1 or cfg.get("ddp") is not None else "auto"),
        use_distributed_sampler=cfg.get("use_distributed_sampler", False),
        max_epochs=cfg.get("max_epochs", 2),
        max_steps=cfg.get("max_steps", -1),
        val_check_interval=cfg.get("val_check_interval") or 1.0,
        check_val_every_n_epoch=cfg.get("check_val_every_n_epoch", 1),
        limit_val_batches=cfg.get("limit_val_batches", 2) if cfg.get("val_check_interval") else 0,
        accumulate_grad_batches=cfg.get("accumulate", 1),
        precision=cfg.get("precision", "32-true"),
        callbacks=callbacks,
        num_sanity_val_steps=0,
    )


def _final_state(trainer: pl.Trainer, model: Model) -> dict:
    """What ``<out>/final.pt`` holds: every piece of training state a resume must restore."""
    return {
        "model": model.state_dict(),
        "optimizer": trainer.optimizers[0].state_dict(),
        "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
        "global_step": trainer.global_step,
        "batches_that_stepped": trainer.fit_loop.epoch_loop._batches_that_stepped,
        "epoch": trainer.current_epoch,
    }


def _cluster(trainer: pl.Trainer) -> dict:
    """Which of Lightning's cluster environments placed this rank, and where (``tests/helpers/slurm_nodes.py``)."""
    environment = getattr(trainer.strategy, "cluster_environment", None)
    address = getattr(environment, "main_address", None)
    return {"environment": type(environment).__name__, "node_rank": trainer.node_rank,
            "num_nodes": trainer.num_nodes, "main_address": address}  # fmt: skip


def main(cfg: dict) -> None:
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    _seed(cfg)
    trainer = _trainer(cfg, _callbacks(cfg, out))
    model = _model(cfg)
    trainer.fit(model, ckpt_path=cfg.get("resume"), weights_only=cfg.get("weights_only"))
    rank = trainer.global_rank
    torch.save(_final_state(trainer, model), out / ("final.pt" if rank == 0 else f"final-rank{rank}.pt"))
    exact = next((cb for cb in trainer.callbacks if isinstance(cb, ExactResume)), None)
    if exact is not None:  # what the resume said it did, for the tests to read: ``<out>/report-rank<R>.json``
        report = {**exact.resume_report.to_dict(), "accumulate_grad_batches_now": trainer.accumulate_grad_batches}
        report["cluster"] = _cluster(trainer)
        saver = getattr(trainer.strategy.checkpoint_io, "_saver", None)
        if getattr(saver, "overlapped", False):  # what the overlapped copies did, for the tests to check
            report["overlap_copy"] = {"guarded": saver.stats.guarded, "recopied": saver.stats.recopied}
        (out / f"report-rank{rank}.json").write_text(json.dumps(report, default=str))
    if torch.distributed.is_initialized():  # close gloo before exit: its threads may otherwise abort the process
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
