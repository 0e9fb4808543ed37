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
from typing import Callable, Literal, Mapping, Optional, Union, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_resume import collective
from lightning_resume._compat import check_versions
from lightning_resume._compat import lightning as lc
from lightning_resume.cas.gc import lineage_of
from lightning_resume.errors import (
    ConfigurationError,
    RetentionWarning,
    TreeFormatError,
)
from lightning_resume.format.atomic import fsync_file_and_dir
from lightning_resume.format.partial import refuse_partly_loaded
from lightning_resume.io.plugin import refuse_unencodable_hparams
from lightning_resume.io.resolve import candidates
from lightning_resume.io.verify import precheck, problem
from lightning_resume.protocols import AsyncCheckpointWriter, offer_module
from lightning_resume.retention.last import OncePerFit, resumed_from
from lightning_resume.retention.mirror import MirrorUploader, Outcome
from lightning_resume.retention.naming import parse_rolling_name, rolling_name
from lightning_resume.retention.policy import ANCHOR, CheckpointRecord, RetentionPolicy
from lightning_resume.retention.records import owned_record, read_checkpoint_callback_state
from lightning_resume.retention.tiers import AnchorUpload, Mirror, TieredPolicy
from lightning_resume.storage import files as storage

_STATE = "retention"
MIRROR_FLUSH_S = 600.0
"""At the end of training, the longest wait for the mirror's uploads (and again for its deletions)."""


class RetentionCheckpoint(lc.ModelCheckpointExtension):
    """``ModelCheckpoint`` plus rolling, best and anchor retention, and a mirror to an object store.

    ``retention=RetentionPolicy(keep_last=3, keep_best=2, anchor_every_n_steps=50_000)`` turns retention on:
    each save writes ``dirpath/step=000000123.ckpt``, and the union of the keep rules decides what stays. The
    resume source, the newest verified checkpoint, saves in flight and files this callback did not write are
    never deleted. ``fit(ckpt_path="last")`` then resolves to the newest file in ``dirpath`` that verifies.
    ``save_top_k`` and ``filename`` are replaced by these rules and must stay unset. ``keep_best`` ranks by
    ``monitor`` in this callback's ``mode``; the policy takes its direction from there.

    Local first, then the object store: with ``mirror=Mirror("s3://bucket/run")`` (any fsspec URL, or another
    local directory) each checkpoint is made durable in ``dirpath``, then uploaded in the background. The
    keep rules decide what the mirror keeps; ``Mirror.local_keep_last`` how many stay on local disk (default:
    the same rules). A local copy is never deleted before the mirror has it. ``Mirror(anchors="sync")`` makes
    a save that becomes an anchor wait for its upload. A failed upload is named in a ``RetentionWarning`` and
    tried again. "last" is the newest checkpoint that verifies in either tier.

    With default arguments this is exactly ``ModelCheckpoint``.
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
        retention: Optional[RetentionPolicy] = None,
        mirror: Optional[Mirror] = None,
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
        problems = group_problems(retention, mirror, self.monitor, self.mode, save_top_k, filename, dirpath)
        if problems:
            raise ConfigurationError(type(self).__name__, problems)
        self.policy = replace(retention or RetentionPolicy(), mode=cast(Literal["min", "max"], self.mode))
        self.tiers = TieredPolicy(self.policy, mirror.local_keep_last) if mirror is not None else None
        self.mirror_anchors = mirror.anchor_upload if mirror is not None else AnchorUpload.ASYNC
        self._mirror = MirrorUploader(mirror.url) if mirror is not None else None
        self._mirror_records: dict = {}  # the mirror's checkpoints, by URL; the local ones are ``_records``
        self._records: dict = {}
        self._resume_source: Optional[str] = None
        self._last = OncePerFit()
        # Proof of ownership: every file this run writes carries its own record and this id in its
        # state; a resumed run takes the id back from the checkpoint, so it still owns its earlier files.
        self._run_id: str = uuid.uuid4().hex

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
        self._mirror_new(trainer, record)
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
        if self._mirror is not None:
            self._flush_mirror(trainer)

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
        """Ask the policy (per tier with a mirror); tag new anchors; delete the rest oldest first (only rank 0
        touches files: Strategy.remove_checkpoint locally, the mirror's queue remotely)."""
        records = list(self._records.values())
        if self.tiers is None:
            decisions, anchors = self.policy.decide(records, self._resume_source), self.policy.anchors(records)
        else:
            self._settle_mirror(trainer)
            decisions = self.tiers.decide_local(records, self._on_mirror(), self._resume_source)
            anchors = self.tiers.local_anchors(records)
        self._carry_out(decisions, anchors, self._records, lambda path: lc.remove_checkpoint_file(self, trainer, path))
        if self.tiers is not None:
            mirrored = list(self._mirror_records.values())
            decisions = self.tiers.decide_mirror(mirrored, self._resume_source)
            remove = self._mirror_remover(trainer)
            self._carry_out(decisions, self.tiers.mirror.anchors(mirrored), self._mirror_records, remove)
        self._update_best_from_records()

    def _carry_out(self, decisions: list, anchors: list, records: dict, remove: Callable[[str], None]) -> None:
        """Delete what ``decisions`` drop (oldest first) from one tier's files and ``records``; tag new anchors."""
        anchor_paths = {r.path for r in anchors}
        for decision in decisions:
            record = decision.record
            if not decision.keep:
                remove(record.path)
                del records[record.path]
            elif record.path in anchor_paths and ANCHOR not in record.tags:
                records[record.path] = replace(record, tags=record.tags | {ANCHOR})
            if self.verbose and not decision.keep:
                rank_zero_warn(
                    f"RetentionCheckpoint deleted {record.path}: {'; '.join(decision.reasons)}",
                    category=RetentionWarning,
                )

    # ---- mirroring ----------------------------------------------------------------------------

    def _mirror_new(self, trainer: pl.Trainer, record: CheckpointRecord) -> None:
        """Queue the upload of a new save (rank 0) once its local file is durable; with
        ``Mirror(anchors="sync")``, wait for it when it becomes an anchor of the mirror."""
        mirror = self._mirror
        if mirror is None or self.tiers is None:
            return
        io = trainer.strategy.checkpoint_io
        writer = io if isinstance(io, AsyncCheckpointWriter) else None
        if trainer.is_global_zero:
            mirror.upload(record.path, lambda: writer is None or not writer.write_in_flight(record.path))
        landing = replace(record, path=mirror.target(record.path))  # the records are the same on every rank
        if not self.tiers.upload_first(list(self._mirror_records.values()), landing, self.mirror_anchors):
            return

        def upload_first() -> None:
            if writer is not None:
                writer.wait(record.path)  # the local write first; its failure is raised here, per on_error
            mirror.wait(record.path, timeout=MIRROR_FLUSH_S)

        def failed(problems: Mapping[int, str]) -> BaseException:
            return RuntimeError(f"rank 0 failed while its save of {record.path} was uploaded first: {problems[0]}")

        # every rank waits with rank 0 on the store, not in the next collective (the group's timeout)
        collective.wait_for_rank_zero(
            f"rank 0's upload of {record.path} to the mirror", upload_first, MIRROR_FLUSH_S + 60, failed
        )

    def _settle_mirror(self, trainer: pl.Trainer) -> None:
        """Count what the mirror now holds (rank 0's uploads, one broadcast), name each upload that failed,
        and queue again the failed ones whose wait is over."""
        mirror = cast(MirrorUploader, self._mirror)
        outcomes = mirror.settle() if trainer.is_global_zero else []
        for outcome in outcomes:
            if outcome.error is not None:
                rank_zero_warn(_upload_failure(mirror, outcome), category=RetentionWarning)
        landed = [(o.source, o.target) for o in outcomes if o.error is None and not o.source_gone]
        for source, target in trainer.strategy.broadcast(landed):
            local = self._records.get(source)
            if local is not None:  # else its local write failed: there is nothing to count
                self._mirror_records[target] = replace(local, path=target, verified=True, in_flight=False)
        if trainer.is_global_zero:
            mirror.retry_due()

    def _on_mirror(self) -> set:
        """The base names of the checkpoints the mirror holds, verified."""
        return {storage.basename(p) for p, r in self._mirror_records.items() if r.verified and not r.in_flight}

    def _mirror_remover(self, trainer: pl.Trainer) -> Callable[[str], None]:
        mirror = cast(MirrorUploader, self._mirror)
        return mirror.remove if trainer.is_global_zero else lambda path: None

    def _upload_missing(self, trainer: pl.Trainer) -> None:
        """At train start (rank 0): queue the upload of every local checkpoint the mirror lacks, oldest first
        (a run killed mid-upload, or one that ended before its uploads did)."""
        if self._mirror is None or not trainer.is_global_zero:
            return
        on_mirror = self._on_mirror()
        for record in sorted(self._records.values(), key=lambda r: r.recency):
            if record.verified and not record.in_flight and storage.basename(record.path) not in on_mirror:
                self._mirror.upload(record.path)

    def _flush_mirror(self, trainer: pl.Trainer) -> None:
        """At the end of training: wait (at most ``MIRROR_FLUSH_S``) for the uploads, count them and prune both
        tiers, collect the mirror's unreferenced packs of a dedupe run's lineage, then wait for the mirror's
        deletions. A local copy the mirror lacks stays, named in a warning;
        the next start with this ``dirpath`` uploads it."""
        mirror = cast(MirrorUploader, self._mirror)
        if trainer.is_global_zero:
            mirror.wait(timeout=MIRROR_FLUSH_S)
        self._apply_retention(trainer)
        if not trainer.is_global_zero:
            return
        newest = max((r for r in self._records.values() if r.verified), key=lambda r: r.recency, default=None)
        lineage = None if newest is None else lineage_of(newest.path)  # a dedupe run's, from its own newest file
        if lineage:
            mirror.collect(lineage)
        mirror.wait(timeout=MIRROR_FLUSH_S)
        on_mirror = self._on_mirror()
        missing = sorted(
            storage.basename(p) for p, r in self._records.items() if r.verified and storage.basename(p) not in on_mirror
        )
        if missing:
            rank_zero_warn(
                f"RetentionCheckpoint: the mirror {mirror.directory} does not have {', '.join(missing)} yet; the"
                f" local copies in {self.dirpath} are kept, and the next start with this dirpath uploads them",
                category=RetentionWarning,
            )

    def _update_best_from_records(self) -> None:
        """Mirror the records into ``ModelCheckpoint``'s best-k fields (``best_model_path``...)."""
        by_name = {storage.basename(r.path): r for r in self._mirror_records.values()}
        by_name.update((storage.basename(r.path), r) for r in self._records.values())  # the local copy first
        candidates = [r for r in by_name.values() if r.verified or r.in_flight]
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
        if stage == "fit" and trainer.is_global_zero:  # before Lightning lists dirpath (a bare "Access Denied")
            self._check_writable(lc.checkpoint_dir(self, trainer))
        super().setup(trainer, pl_module, stage)
        self._last.clear()  # Lightning's "last" search is over: the next fit resolves afresh
        if stage == "fit":
            offer_module(trainer, pl_module)  # the restore that follows reads the weights into it
            refuse_unencodable_hparams(trainer, pl_module)  # not at the first save, hours in
        if self.policy.active and isinstance(trainer.strategy.checkpoint_io, AsyncCheckpointIO):
            # It returns before the file exists and says nothing when it does: a prune could then
            # delete the newest durable checkpoint while its successor is still being written.
            raise ConfigurationError(
                type(self).__name__,
                [
                    "Lightning's AsyncCheckpointIO cannot tell when a file is durable, so retention cannot run"
                    " safely with it; use plugins=[SafetensorsCheckpointIO(save='async')] instead"
                ],
            )
        if self._mirror is not None and trainer.world_size > 1 and not _replicated(trainer):
            raise ConfigurationError(
                type(self).__name__,
                [
                    f"mirror.url={self._mirror.directory!r} copies single-file checkpoints, and this strategy writes"
                    " a sharded directory per save; remove mirror, or save single files (DDP)"
                ],
            )

    def _check_writable(self, dirpath: str) -> None:
        """A remote ``dirpath`` that cannot be written or listed (a missing bucket, a denied prefix) fails the fit
        now, naming it, not at the first save; a mirror that cannot is warned about, and training goes on (its
        uploads are retried and named as they fail)."""
        storage.check_writable(dirpath)
        if self._mirror is not None:
            try:
                storage.check_writable(self._mirror.directory)
            except OSError as err:
                rank_zero_warn(
                    f"RetentionCheckpoint: the mirror {self._mirror.directory} cannot be written now ({err}); training"
                    " goes on, local checkpoints are kept until the mirror has them",
                    category=RetentionWarning,
                )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        offer_module(trainer, None)  # the restore is over: no later load may read into the live module
        refuse_partly_loaded(trainer)  # not on weights an earlier failed load left half-written (format.partial)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if not self.policy.active:
            return
        resume = resumed_from(trainer)  # a fallback when the newest failed its hash while loading
        self._resume_source = _canonical(resume) if resume else None
        self._run_id = trainer.strategy.broadcast(self._run_id)  # one run, one id on every rank
        io, weights_only = trainer.strategy.checkpoint_io, lc.fit_weights_only(trainer) is not False
        check = lambda p: problem(p, io, weights_only=weights_only)  # read as the resume read them
        self._records = self._reconciled_tier(trainer, str(self.dirpath), self._records, check)
        if self._mirror is not None:  # an object listed was committed whole: its header is checked, not every byte
            check = lambda p: problem(p, check=precheck)
            self._mirror_records = self._reconciled_tier(trainer, self._mirror.directory, self._mirror_records, check)
            self._upload_missing(trainer)
        self._apply_retention(trainer)

    def _reconciled_tier(self, trainer: pl.Trainer, directory: str, saved: dict, check: Callable) -> dict:
        """Rank 0's reconciled records of one tier, broadcast, so that every rank holds the same."""
        records = self._reconciled(directory, saved, check) if trainer.is_global_zero else []
        return {r.path: r for r in trainer.strategy.broadcast(records)}

    def _reconciled(self, directory: str, saved: dict, check: Callable[[str], Optional[str]]) -> list:
        """One tier's records from the state, checked against the files now in ``directory`` (rank 0 reads)."""
        records = []
        for path in (e.path for e in candidates(directory, (self.FILE_EXTENSION,))):
            if parse_rolling_name(path, self.FILE_EXTENSION) is None:
                continue  # not our naming: never ours to delete, not ours to track
            known = saved.get(path) or self._record_from_file(path)
            if known is None:
                continue  # no record of this run names it: another callback's or another run's file
            if known.in_flight or path not in saved:
                why = None if path == self._resume_source else check(path)
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
    def mirror_directory(self) -> Optional[str]:
        """Where this callback mirrors its checkpoints (``mirror.url``), or ``None``."""
        return None if self._mirror is None else self._mirror.directory

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
            if self._mirror is not None:
                mirrored = sorted(self._mirror_records.values(), key=lambda r: r.recency)
                state[_STATE]["mirror"] = [r.to_state() for r in mirrored]
        return state

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        same_dir = state_dict.get("dirpath", self.dirpath) == self.dirpath
        if self.policy.active and same_dir and _STATE in state_dict:
            saved = _records_from_state(state_dict[_STATE])
            self._records = {r.path: r for r in saved}
            mirrored = _records_from_state({"records": state_dict[_STATE].get("mirror")})
            self._mirror_records = {r.path: r for r in mirrored} if self._mirror is not None else {}
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


def _upload_failure(mirror: MirrorUploader, outcome: Outcome) -> str:
    """The warning for a failed upload: what, why, and what happens next."""
    wait = mirror.retry.delay(outcome.failures)
    return (
        f"RetentionCheckpoint: mirror {outcome.error} (failure {outcome.failures} in a row). Training goes on;"
        f" the local copy is kept until the mirror has it, and the upload is tried again at a save {wait:.0f}s"
        " from now or later."
    )


def group_problems(
    retention: object,
    mirror: object,
    monitor: Optional[str],
    mode: str,
    save_top_k: int,
    filename: Optional[str],
    dirpath: object,
) -> list[str]:
    """Every problem with the ``retention`` and ``mirror`` groups and how they meet the rest of the callback's
    arguments, each naming the option path (``retention.keep_best``), the value and the fix. Each group checks
    its own values when it is built."""
    if retention is not None and not isinstance(retention, RetentionPolicy):
        return [f"retention={retention!r} is not a RetentionPolicy; use retention=RetentionPolicy(keep_last=3)"]
    if mirror is not None and not isinstance(mirror, Mirror):
        return [f"mirror={mirror!r} is not a Mirror; use mirror=Mirror('s3://bucket/run')"]
    policy = retention or RetentionPolicy()
    problems = []
    if policy.mode is not None and policy.mode != mode:
        problems.append(
            f"retention.mode={policy.mode!r} conflicts with mode={mode!r}; remove retention.mode"
            " (retention ranks in the callback's mode)"
        )
    if policy.keep_best is not None and monitor is None:
        problems.append(
            f"retention.keep_best={policy.keep_best} needs a metric; set monitor to a logged key such as 'val/loss'"
        )
    if policy.active and save_top_k != 1:
        problems.append(
            f"save_top_k={save_top_k} conflicts with the retention rules; remove it and use retention.keep_best"
        )
    if policy.active and filename is not None:
        problems.append(f"filename={filename!r} is unused: retention names files step=000000123.ckpt; remove it")
    if isinstance(mirror, Mirror):
        problems += _mirror_problems(mirror, policy, dirpath)
    return problems


def _mirror_problems(mirror: Mirror, policy: RetentionPolicy, dirpath: object) -> list[str]:
    """How the mirror meets the keep rules and ``dirpath``: each problem names the option, the value and the fix."""
    problems = []
    if not policy.active:
        problems.append(
            f"mirror.url={mirror.url!r} needs a retention rule to apply per tier; set retention.keep_last"
            " (e.g. RetentionPolicy(keep_last=3)), retention.keep_best or an anchor rule"
        )
    if mirror.anchors == "sync" and policy.anchor_every_n_steps is None and policy.anchor_every is None:
        problems.append(
            "mirror.anchors='sync' waits for the upload of anchors, but no anchor rule is set;"
            " set retention.anchor_every_n_steps or retention.anchor_every, or use mirror.anchors='async'"
        )
    if dirpath is not None and _canonical(mirror.url).rstrip("/") == _canonical(str(dirpath)).rstrip("/"):
        problems.append(
            f"mirror.url={mirror.url!r} is dirpath itself; use another location (the mirror is a second copy)"
        )
    return problems


def _canonical(path: str) -> str:
    """The resume source as records name it: a real local path, or the URL unchanged (scheme kept)."""
    return str(path) if "://" in str(path) else os.path.realpath(path)


def _replicated(trainer: pl.Trainer) -> bool:
    """Only rank 0 writes (DDP): the others must wait for its writes. A sharded strategy's ranks each write."""
    return isinstance(trainer.strategy, DDPStrategy) and not isinstance(trainer.strategy, DeepSpeedStrategy)
