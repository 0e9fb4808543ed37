"""``RetentionCheckpoint``: Lightning's ``ModelCheckpoint`` with a retention policy (the hook).

This module connects Lightning to ``retention.policy`` (what to keep), ``retention.naming`` and
``retention.records`` (names, files on disk) and ``io`` (verification, the "last" resolver, fsync).
It gathers records, asks the policy, deletes in order on rank 0, and keeps the
records in its ``state_dict``. It holds no retention rule itself. With no retention argument set it
is exactly ``ModelCheckpoint``: every override below falls through to the parent in that case.
"""

import math
import os
import time
import uuid
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Literal, Optional, Union, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_resume import collective, storage
from lightning_resume._compat import check_versions
from lightning_resume._compat import lightning as lc
from lightning_resume.durations import Duration, parse_duration
from lightning_resume.errors import (
    ConfigurationError,
    RetentionWarning,
    TreeFormatError,
)
from lightning_resume.io.atomic import fsync_file_and_dir
from lightning_resume.io.resolve import candidates
from lightning_resume.io.verify import problem
from lightning_resume.protocols import AsyncCheckpointWriter
from lightning_resume.retention.last import OncePerFit, resumed_from
from lightning_resume.retention.naming import parse_rolling_name, rolling_name
from lightning_resume.retention.policy import ANCHOR, CheckpointRecord, RetentionPolicy, policy_problems
from lightning_resume.retention.records import owned_record, read_checkpoint_callback_state

_STATE = "retention"


class RetentionCheckpoint(lc.ModelCheckpointExtension):
    """``ModelCheckpoint`` plus rolling (``keep_last``), best (``keep_best``) and anchor retention.

    When any of ``keep_last``, ``keep_best``, ``anchor_every_n_steps``, ``anchor_every`` is set, each
    save writes ``dirpath/step=000000123.ckpt``; the union of the keep rules decides what stays, and
    the resume source, the newest verified checkpoint, saves in flight and files this callback did not
    write are never deleted. ``fit(ckpt_path="last")`` then resolves to the newest file in ``dirpath``
    that verifies. ``save_top_k`` and ``filename`` are replaced by these rules and must stay unset.
    """

    def __init__(
        self,
        dirpath: Optional[Union[str, Path]] = None,
        filename: Optional[str] = None,
        monitor: Optional[str] = None,
        verbose: bool = False,
        save_last: Optional[Union[bool, Literal["link"]]] = None,
        save_top_k: int = 1,
        save_on_exception: bool = False,
        save_weights_only: bool = False,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: Optional[int] = None,
        train_time_interval: Optional[timedelta] = None,
        every_n_epochs: Optional[int] = None,
        save_on_train_epoch_end: Optional[bool] = None,
        enable_version_counter: bool = True,
        keep_last: Optional[int] = None,
        keep_best: Optional[int] = None,
        anchor_every_n_steps: Optional[int] = None,
        anchor_every: Optional[Duration] = None,
    ) -> None:
        check_versions()
        lc.resolve_last_through_callbacks()
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            monitor=monitor,
            verbose=verbose,
            save_last=save_last,
            save_top_k=save_top_k,
            save_on_exception=save_on_exception,
            save_weights_only=save_weights_only,
            mode=mode,
            auto_insert_metric_name=auto_insert_metric_name,
            every_n_train_steps=every_n_train_steps,
            train_time_interval=train_time_interval,
            every_n_epochs=every_n_epochs,
            save_on_train_epoch_end=save_on_train_epoch_end,
            enable_version_counter=enable_version_counter,
        )
        self.policy = self._build_policy(filename, save_top_k, keep_last, keep_best, anchor_every_n_steps, anchor_every)
        self._records: dict = {}
        self._resume_source: Optional[str] = None
        self._last = OncePerFit()
        # Proof of ownership: every file this run writes carries its own record and this id in its
        # state; a resumed run takes the id back from the checkpoint, so it still owns its earlier files.
        self._run_id: str = uuid.uuid4().hex

    def _build_policy(self, filename, save_top_k, keep_last, keep_best, anchor_every_n_steps, anchor_every):
        problems = []
        seconds = None
        if anchor_every is not None:
            try:
                seconds = parse_duration(anchor_every, "anchor_every")
            except ValueError as err:
                problems.append(str(err))
        problems += policy_problems(keep_last, keep_best, self.mode, anchor_every_n_steps, seconds)
        active = any(v is not None for v in (keep_last, keep_best, anchor_every_n_steps, anchor_every))
        if keep_best is not None and self.monitor is None:
            problems.append(f"keep_best={keep_best} needs a metric; set monitor to a logged key such as 'val/loss'")
        if active and save_top_k != 1:
            problems.append(f"save_top_k={save_top_k} conflicts with the retention rules; remove it and use keep_best")
        if active and filename is not None:
            problems.append(f"filename={filename!r} is unused: retention names files step=000000123.ckpt; remove it")
        if problems:
            raise ConfigurationError(type(self).__name__, problems)
        mode = cast(Literal["min", "max"], self.mode)  # policy_problems refused any other mode above
        return RetentionPolicy(keep_last, keep_best, mode, anchor_every_n_steps, seconds)

    @property
    @override
    def state_key(self) -> str:
        """The key stock ``ModelCheckpoint`` uses for the same arguments, so either can resume the other."""
        key = super().state_key
        return ModelCheckpoint.__qualname__ + key[len(type(self).__qualname__) :]

    # ---- saving -------------------------------------------------------------------------------

    @override
    def topk_save(self, trainer: pl.Trainer, monitor_candidates: dict) -> None:
        if not self.policy.active:
            return super().topk_save(trainer, monitor_candidates)
        self._save_retained(trainer, monitor_candidates, tag="rolling")

    @property
    def accepts_snapshots(self) -> bool:
        """Only with a retention rule: with default arguments this is exactly ``ModelCheckpoint``, whose
        top-k bookkeeping scheduled snapshots must not touch (they go beside its files instead)."""
        return self.policy.active

    def save_snapshot(self, trainer: pl.Trainer, reason: str) -> str:
        """Write a full checkpoint now (all ranks must call), counted as rolling; return its path."""
        path = self._rolling_path(trainer.global_step)
        if lc.last_global_step_saved(self) == trainer.global_step and path in self._records:
            return path  # this step is already on disk; the same state would be written again
        return self._save_retained(trainer, lc.monitor_candidates(self, trainer), tag="scheduled")

    def _save_retained(self, trainer: pl.Trainer, monitor_candidates: dict, tag: str) -> str:
        """Save, make durable, then prune: a crash in between leaves extra files only."""
        path = self._rolling_path(trainer.global_step)
        writer = trainer.strategy.checkpoint_io
        if trainer.world_size > 1 and isinstance(writer, AsyncCheckpointWriter) and _replicated(trainer):
            # before the collectives below: the others would wait in them, under the group's timeout, for rank 0
            collective.wait_for_rank_zero_writes(writer, "the end of rank 0's previous checkpoint write")
        # rank 0's clock and metric, so every rank holds the same records and decides the same
        now, metric = trainer.strategy.broadcast((time.time(), self._metric_of(monitor_candidates)))
        record = CheckpointRecord(
            path,
            trainer.global_step,
            trainer.current_epoch,
            now,
            metric,
            frozenset({tag}),
            verified=False,
            in_flight=True,
            owned=True,
            seq=1 + max((r.seq for r in self._records.values()), default=0),
        )
        self._records[path] = record
        self.current_score = None if metric is None else torch.tensor(metric)
        self._update_best_from_records()  # part of the state written into this very file
        lc.save_checkpoint_file(self, trainer, path)
        if isinstance(writer, AsyncCheckpointWriter):
            self._settle_async_writes(trainer, writer)
        else:
            if trainer.is_global_zero:
                fsync_file_and_dir(path)
            self._records[path] = replace(record, verified=True, in_flight=False)
        self._apply_retention(trainer)
        return path

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Async IO: once the last write is durable (teardown would wait for it anyway), count it and prune."""
        super().on_train_end(trainer, pl_module)
        writer = trainer.strategy.checkpoint_io
        if self.policy.active and isinstance(writer, AsyncCheckpointWriter):
            if _replicated(trainer):  # every rank waits with rank 0, outside the broadcast below (NCCL's watchdog)
                collective.wait_for_rank_zero_writes(writer, "the end of rank 0's last checkpoint write")
            else:  # a sharded writer: each rank its own writes (and their commit agreement)
                writer.wait()
            self._settle_async_writes(trainer, writer)
            self._apply_retention(trainer)

    def _settle_async_writes(self, trainer: pl.Trainer, writer: AsyncCheckpointWriter) -> None:
        """Async IO: a file stays in flight (never deleted, never "newest verified") until its atomic
        commit is done. Rank 0's writer knows; one broadcast keeps every rank's records the same. A
        write that failed (``on_error="warn"``) leaves no file, so its record is dropped."""
        settled: dict[str, bool] = {}  # rank 0's is broadcast to every rank
        if trainer.is_global_zero:
            pending = [p for p, r in self._records.items() if r.in_flight]
            settled = {p: storage.exists(p) for p in pending if not writer.write_in_flight(p)}
        for path, durable in trainer.strategy.broadcast(settled).items():
            if durable:
                self._records[path] = replace(self._records[path], verified=True, in_flight=False)
            else:
                del self._records[path]

    def _rolling_path(self, step: int) -> str:
        return storage.join(str(self.dirpath), rolling_name(step, self.FILE_EXTENSION))

    def _metric_of(self, monitor_candidates: dict) -> Optional[float]:
        value = monitor_candidates.get(self.monitor) if self.monitor else None
        if value is None:
            return None
        value = float(value)
        return None if math.isnan(value) else value

    # ---- pruning ------------------------------------------------------------------------------

    def _apply_retention(self, trainer: pl.Trainer) -> None:
        """Ask the policy; tag new anchors; delete the rest oldest first (only rank 0 touches files)."""
        records = list(self._records.values())
        anchors = {r.path for r in self.policy.anchors(records)}
        for decision in self.policy.decide(records, self._resume_source):
            record = decision.record
            if not decision.keep:
                lc.remove_checkpoint_file(self, trainer, record.path)  # Strategy.remove_checkpoint: rank 0 only
                del self._records[record.path]
            elif record.path in anchors and ANCHOR not in record.tags:
                self._records[record.path] = replace(record, tags=record.tags | {ANCHOR})
            if self.verbose and not decision.keep:
                rank_zero_warn(
                    f"RetentionCheckpoint deleted {record.path}: {'; '.join(decision.reasons)}",
                    category=RetentionWarning,
                )
        self._update_best_from_records()

    def _update_best_from_records(self) -> None:
        """Mirror the records into ``ModelCheckpoint``'s best-k fields (``best_model_path``...)."""
        candidates = [r for r in self._records.values() if r.verified or r.in_flight]
        ranked = self.policy.ranked_by_metric([replace(r, verified=True, in_flight=False) for r in candidates])
        if not ranked:
            return
        best = ranked[: self.policy.keep_best or len(ranked)]
        self.best_k_models = {r.path: torch.tensor(r.metric) for r in best}
        self.best_model_path, self.best_model_score = best[0].path, torch.tensor(best[0].metric)
        self.kth_best_model_path, self.kth_value = best[-1].path, torch.tensor(best[-1].metric)

    # ---- resuming -----------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._last.clear()  # Lightning's "last" search is over: the next fit resolves afresh
        if self.policy.active and isinstance(trainer.strategy.checkpoint_io, AsyncCheckpointIO):
            # It returns before the file exists and says nothing when it does: a prune could then
            # delete the newest durable checkpoint while its successor is still being written.
            raise ConfigurationError(
                type(self).__name__,
                [
                    "Lightning's AsyncCheckpointIO cannot tell when a file is durable, so retention cannot run"
                    " safely with it; use plugins=[SafetensorsCheckpointIO(async_save=True)] instead"
                ],
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if not self.policy.active:
            return
        resume = resumed_from(trainer)  # a fallback when the newest failed its hash while loading
        self._resume_source = _canonical(resume) if resume else None
        self._run_id = trainer.strategy.broadcast(self._run_id)  # one run, one id on every rank
        records = self._reconciled_records(trainer) if trainer.is_global_zero else []  # rank 0's is broadcast
        self._records = {r.path: r for r in trainer.strategy.broadcast(records)}
        self._apply_retention(trainer)

    def _reconciled_records(self, trainer: pl.Trainer) -> list:
        """Records from the state, checked against the files now in ``dirpath`` (rank 0 reads disk)."""
        io = trainer.strategy.checkpoint_io
        records = []
        for path in (e.path for e in candidates(str(self.dirpath), (self.FILE_EXTENSION,))):
            if parse_rolling_name(path, self.FILE_EXTENSION) is None:
                continue  # not our naming: never ours to delete, not ours to track
            known = self._records.get(path) or self._record_from_file(path)
            if known is None:
                continue  # no record of this run names it: another callback's or another run's file
            if known.in_flight or path not in self._records:
                why = None if path == self._resume_source else problem(path, io)
                if why is not None:
                    rank_zero_warn(
                        f"RetentionCheckpoint: {path} does not verify ({why}); it is kept, not counted.",
                        category=RetentionWarning,
                    )
                known = replace(known, in_flight=False, verified=why is None)
            records.append(known)
        return records

    def _record_from_file(self, path: str) -> Optional[CheckpointRecord]:
        """The record this run saved inside ``path`` itself, or ``None`` if the file does not prove it is
        ours (its state names another run, or no record for it: another callback's or run's file)."""
        state = read_checkpoint_callback_state(path, self.state_key) or {}
        saved = owned_record(state.get(_STATE), path, self._run_id)
        if saved is None:
            return None
        try:
            return replace(CheckpointRecord.from_state(saved), path=path, owned=True)
        except TreeFormatError:
            return None  # a record this version cannot read proves nothing: the file is not tracked

    @property
    def resolves_last(self) -> bool:
        """With a retention rule, ``ckpt_path="last"`` is the newest checkpoint that verifies (``retention.last``);
        without one, Lightning's own rule (the drop-in promise)."""
        return self.policy.active

    def resolve_last(self, trainer: pl.Trainer) -> set[str]:
        """``ckpt_path="last"``: the newest checkpoint of the trainer's checkpoint callbacks that verifies."""
        return self._last.resolve(trainer)

    # ---- state --------------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.policy.active:
            records = [r.to_state() for r in sorted(self._records.values(), key=lambda r: r.recency)]
            state[_STATE] = {"run_id": self._run_id, "records": records}
        return state

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        same_dir = state_dict.get("dirpath", self.dirpath) == self.dirpath
        if self.policy.active and same_dir and _STATE in state_dict:
            saved = _records_from_state(state_dict[_STATE])
            self._records = {r.path: r for r in saved}
            self._run_id = str(state_dict[_STATE].get("run_id") or self._run_id)  # resuming continues the run


def _records_from_state(state: object) -> list:
    """The records of a saved state; one this version cannot read is dropped with a warning (its file is
    then not tracked, so never deleted), never a crash at train start."""
    saved = state.get("records") if isinstance(state, dict) else None
    records = []
    for raw in saved if isinstance(saved, (list, tuple)) else []:
        try:
            records.append(CheckpointRecord.from_state(raw))
        except TreeFormatError as err:
            rank_zero_warn(
                f"RetentionCheckpoint: ignoring a saved record it cannot read ({err})", category=RetentionWarning
            )
    return records


def _canonical(path: str) -> str:
    """The resume source as records name it: a real local path, or the URL unchanged (scheme kept)."""
    return str(path) if "://" in str(path) else os.path.realpath(path)


def _replicated(trainer: pl.Trainer) -> bool:
    """Only rank 0 writes (DDP): the others must wait for its writes. A sharded strategy's ranks each write."""
    return isinstance(trainer.strategy, DDPStrategy) and not isinstance(trainer.strategy, DeepSpeedStrategy)
