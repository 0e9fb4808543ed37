"""ExactResume: the Lightning hooks that make every checkpoint resume bit for bit.

Thin by design. At save time it gathers, per rank, the state Lightning leaves out (RNG streams, the
data position aligned with the last trained batch, a fingerprint) and at resume it restores them at
the one moment that makes the next step identical to the uninterrupted run's: ``on_train_start``,
after Lightning created the training iterator (which draws from the global RNG) and before the
first batch is fetched. The mechanisms live in ``lightning_resume.state``; Lightning internals in
``lightning_resume._lightning``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Literal, Mapping, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torchdata.stateful_dataloader.stateful import Stateful

from lightning_resume import _lightning as lt
from lightning_resume import ranks, snapshots
from lightning_resume.durations import Duration
from lightning_resume.errors import ConfigurationError, ResumeMismatchError
from lightning_resume.preemption import DEFAULT_SIGNALS, PreemptionFlag
from lightning_resume.schedule import ScheduleConfig
from lightning_resume.scheduling import SnapshotScheduler
from lightning_resume.state.data import loader_problems, loader_signature, remap_position
from lightning_resume.state.fingerprint import digest, fingerprint, fingerprint_mismatches
from lightning_resume.state.rng import capture_rng, restore_rng, rng_mismatches

FORMAT_VERSION = 1
NOT_RESTORED_WITHOUT_EXACT_RESUME = (
    "RNG streams (Python, NumPy, torch CPU/CUDA, registered generators), the data position aligned with"
    " the last trained batch, loader worker RNG, validation due at the saved step"
)


class ExactResume(Callback):
    """Make every checkpoint the trainer writes resumable bit for bit, and take snapshots on the
    optimal schedule.

    Args:
        generators: extra ``torch.Generator`` objects to save and restore, by name
            (e.g. a generator your augmentation draws from).
        strict: if ``True`` (default), a checkpoint that does not fit this run (world size, loader
            configuration, dataset length, model or optimizer structure, a fingerprint that does not
            match after restore) raises ``ResumeMismatchError``. If ``False``, training continues
            approximately and a warning lists what will not be exact.
        fingerprint: record digests of weights, optimizer, RNG and data state in each checkpoint and
            check them after restore. Costs one pass of hashing over the state at each save.
        mtbf: mean time between failures of one node (``"24h"``, seconds or a ``timedelta``), or
            ``"observed"`` to estimate it from this run's failure history with ``mtbf_prior`` as the
            prior. Snapshots are then taken every T* = sqrt(2 C M) (Young; ``formula="daly"`` for
            Daly's refinement), C being the measured blocking time of a save and M = mtbf / nodes.
            ``None`` (default) takes no scheduled snapshots; every other checkpoint stays exact.
        num_nodes: nodes sharing the failure rate (default: the trainer's ``num_nodes``).
        min_interval, max_interval: bounds on the interval between snapshots.
        every_n_train_steps_max: take a snapshot at least every this many optimizer steps.
        mtbf_prior: the prior MTBF for ``mtbf="observed"``.
        initial_cost: conservative guess of C before the first measurement (the first snapshot
            comes after ``min_interval`` to measure it).
        check_interval: longest time between two schedule decisions; also bounds how late a
            preemption signal is acted on in multi-process runs.
        preemption_signals: signals that request a snapshot and a clean stop at the next step
            boundary (the handler only sets a flag). ``None`` or ``[]`` leaves signals alone.
        clock: monotonic clock in seconds (tests pass a fake one).
    """

    def __init__(
        self,
        generators: Optional[dict[str, torch.Generator]] = None,
        strict: bool = True,
        fingerprint: bool = True,
        mtbf: Optional[Duration] = None,
        num_nodes: Optional[int] = None,
        formula: Literal["young", "daly"] = "young",
        min_interval: Duration = "1min",
        max_interval: Duration = "6h",
        every_n_train_steps_max: Optional[int] = None,
        mtbf_prior: Optional[Duration] = None,
        initial_cost: Duration = "60s",
        check_interval: Duration = "10s",
        preemption_signals: Optional[Sequence[str]] = DEFAULT_SIGNALS,
        clock: Optional[Callable[[], float]] = None,
    ) -> None:
        self.generators: dict[str, torch.Generator] = dict(generators or {})
        self.strict = strict
        self.fingerprint = fingerprint
        self.preemption = PreemptionFlag(preemption_signals) if preemption_signals else None
        self.scheduler = _make_scheduler(
            mtbf, num_nodes, formula, min_interval, max_interval, every_n_train_steps_max,
            mtbf_prior, initial_cost, check_interval, clock, checks_needed=self.preemption is not None,
        )
        self._num_nodes = num_nodes
        self.preempted = False
        self._trainer: Optional[pl.Trainer] = None
        self._pending: Optional[dict[str, Any]] = None
        self._phase = "idle"
        self.resume_report: dict[str, Any] = {}

    @property
    def state_key(self) -> str:
        return "ExactResume"

    # ----------------------------------------------------------------------------------- hooks
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._trainer = trainer
        if (warning := lt.check_version()) is not None:
            rank_zero_warn(warning)
        if snapshots.snapshot_target(trainer) is None and snapshots.first_model_checkpoint(trainer) is None:
            if self.scheduler is not None and self.scheduler.takes_snapshots:
                raise ConfigurationError(
                    "ExactResume", ["scheduled snapshots need a checkpoint directory: add a RetentionCheckpoint or"
                                    " ModelCheckpoint, or leave mtbf and every_n_train_steps_max unset"]
                )
            if self.preemption is not None:
                rank_zero_warn("ExactResume: no checkpoint callback, so preemption signals cannot save a snapshot;"
                               " they keep their default behaviour")
                self.preemption = None

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._warn_about_loaders(trainer)
        pending, self._pending = self._pending, None
        if pending is not None:
            self._restore(trainer, pl_module, pending)
        if self.scheduler is not None:
            self._start_schedule(trainer, pending or {})
        if self.preemption is not None:
            self.preemption.install()  # after Lightning's own SIGTERM handler (trainer.py:1074), replacing it

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.scheduler is not None:
            self.scheduler.clean_stop(trainer.is_global_zero)

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if self.preemption is not None:
            self.preemption.uninstall()

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        # Lightning does not call ``teardown`` on callbacks after an exception: give the signals back now.
        if self.preemption is not None:
            self.preemption.uninstall()

    def on_train_batch_start(self, trainer: "pl.Trainer", *args: Any) -> None:
        self._phase = "batch"

    def on_train_batch_end(self, trainer: "pl.Trainer", *args: Any) -> None:
        self._phase = "batch_end"
        if self.scheduler is not None and lt.at_optimizer_step(trainer):
            self._scheduled_snapshot(trainer)

    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._phase = "validation"

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._phase = "epoch_end"

    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        if trainer is None or not trainer.training and not trainer.validating:
            return {}
        local = self._capture(trainer)
        return {
            "format": FORMAT_VERSION,
            "saved_at": time.time(),
            "schedule": self.scheduler.state_dict() if self.scheduler is not None else {},
            "world_size": trainer.world_size,
            "signature": self._signature(trainer),
            "ranks": ranks.gather(local, trainer.world_size),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict if state_dict else None

    def on_load_checkpoint(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: dict[str, Any]
    ) -> None:
        if checkpoint.get("callbacks", {}).get(self.state_key):
            lt.drop_loader_state(checkpoint)
        else:
            rank_zero_warn(
                "ExactResume: this checkpoint was written without ExactResume; training resumes but these are not"
                f" restored: {NOT_RESTORED_WITHOUT_EXACT_RESUME}. The resumed run will differ from an uninterrupted one."
            )

    # ----------------------------------------------------------------------------------- capture
    def _capture(self, trainer: "pl.Trainer") -> dict[str, Any]:
        loaders = lt.train_loaders(trainer)
        states = [dl.state_dict() if isinstance(dl, Stateful) else None for dl in loaders]
        prefetched = lt.prefetched_batches(trainer)
        local = {
            "rank": trainer.global_rank,
            "rng": capture_rng(self.generators),
            "loaders": states,
            "prefetched": prefetched,
            "epoch_exhausted": lt.epoch_exhausted(trainer),
            "validation_pending": self._phase == "batch_end" and lt.validation_due(trainer),
        }
        if self.fingerprint:
            local["fingerprint"] = self._fingerprint(trainer, local["rng"], [states, prefetched])
        return local

    def _fingerprint(self, trainer: "pl.Trainer", rng: Any, data: Any) -> dict[str, str]:
        return fingerprint(
            trainer.lightning_module.state_dict(),
            [opt.state_dict() for opt in trainer.optimizers],
            rng,
            data,
            trainer.global_step,
        )

    def _signature(self, trainer: "pl.Trainer") -> dict[str, Any]:
        module = trainer.lightning_module
        return {
            "loaders": [loader_signature(dl) for dl in lt.train_loaders(trainer)],
            "model": digest([(n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]),
            "optimizers": [
                [type(opt).__name__, [len(g["params"]) for g in opt.param_groups]] for opt in trainer.optimizers
            ],
        }

    # ----------------------------------------------------------------------------------- restore
    def _restore(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", saved: dict[str, Any]) -> None:
        differences = ranks.agreed(trainer, self._differences(trainer, saved))
        if differences:
            self._refuse_or_warn(differences)
        mine = self._state_for_this_rank(trainer, saved)
        restored_rng = self._restore_position_and_rng(trainer, mine, saved)
        self.resume_report = {"step": trainer.global_step, "exact": not differences, "differences": differences}
        if self.fingerprint and "fingerprint" in mine:
            self._check_fingerprint(trainer, mine, restored_rng)

    def _state_for_this_rank(self, trainer: "pl.Trainer", saved: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's saved state; on another world size (``strict=False`` only), rank ``r % old``'s RNG
        and the data position remapped so the epoch's consumed samples are skipped, not retrained."""
        ranks, old_world = saved["ranks"], int(saved.get("world_size", 1))
        mine = dict(ranks[trainer.global_rank % len(ranks)])
        if old_world == trainer.world_size:
            return mine
        loaders, notes = [], []
        for loader, state in zip(lt.train_loaders(trainer), mine["loaders"]):
            try:
                state, note = remap_position(state, old_world, trainer.world_size, loader.batch_size)
                notes.append(note)
            except (ValueError, TypeError, AttributeError) as err:
                state = None
                notes.append(f"data position not restored ({err}); the epoch restarts from its beginning")
            loaders.append(state)
        mine.update(loaders=loaders, prefetched=[])
        rank_zero_warn("ExactResume(strict=False): " + "; ".join(notes))
        return mine

    def _restore_position_and_rng(self, trainer: "pl.Trainer", mine: Mapping[str, Any], saved: Mapping[str, Any]) -> Any:
        """Restore in the order the uninterrupted run consumed randomness; return the RNG as restored."""
        loaders = lt.train_loaders(trainer)
        signatures = saved.get("signature", {}).get("loaders", [])
        for i, (loader, state) in enumerate(zip(loaders, mine["loaders"])):
            if state is None or not isinstance(loader, Stateful):
                continue
            if i < len(signatures) and signatures[i].get("num_workers") != loader_signature(loader)["num_workers"]:
                rank_zero_warn(f"ExactResume: train loader {i} changed num_workers; its epoch restarts from the beginning")
                continue
            loader.load_state_dict(state)
        if mine["epoch_exhausted"]:
            lt.apply_loader_states(loaders)
        else:
            lt.restart_train_iterator(trainer, mine["prefetched"])
        restore_rng(mine["rng"], self.generators)
        restored_rng = capture_rng(self.generators)
        if mine["validation_pending"] and mine["epoch_exhausted"]:
            lt.run_validation(trainer)
        elif mine["validation_pending"]:
            lt.defer_validation_to_loop(trainer)
        if mine["epoch_exhausted"]:
            # The next epoch's iterator is made now, after the RNG it draws its seed from is restored.
            lt.set_sampler_epoch(loaders, trainer.current_epoch)
            lt.restart_train_iterator(trainer)
            lt.skip_validation_fast_forward(trainer)
        return restored_rng

    def _differences(self, trainer: "pl.Trainer", saved: Mapping[str, Any]) -> list[str]:
        out = []
        if saved.get("format") != FORMAT_VERSION:
            out.append(f"ExactResume state format {saved.get('format')!r}, this version reads {FORMAT_VERSION}")
        if saved.get("world_size") != trainer.world_size:
            out.append(
                f"world size: checkpoint written by {saved.get('world_size')} processes, this run has"
                f" {trainer.world_size} (each rank's RNG and data position cannot be mapped)"
            )
        now = self._signature(trainer)
        then = saved.get("signature", {})
        for i, (a, b) in enumerate(zip(then.get("loaders", []), now["loaders"])):
            out += [f"train loader {i} {k}: checkpoint {a.get(k)!r}, now {b.get(k)!r}" for k in b if a.get(k) != b[k]]
        if len(then.get("loaders", [])) != len(now["loaders"]):
            out.append(f"number of train loaders: checkpoint {len(then.get('loaders', []))}, now {len(now['loaders'])}")
        if then.get("model") != now["model"]:
            out.append("model structure (parameter names, shapes or dtypes) differs from the checkpoint")
        if then.get("optimizers") != now["optimizers"]:
            out.append(f"optimizer structure: checkpoint {then.get('optimizers')}, now {now['optimizers']}")
        ranks = saved.get("ranks", [])
        if trainer.global_rank < len(ranks):
            out += rng_mismatches(ranks[trainer.global_rank]["rng"], self.generators)
        return out

    def _check_fingerprint(self, trainer: "pl.Trainer", mine: Mapping[str, Any], restored_rng: Any) -> None:
        restored = self._fingerprint(trainer, restored_rng, None)
        bad = fingerprint_mismatches(mine["fingerprint"], restored, ("weights", "optimizer", "rng", "step"))
        bad = ranks.agreed(trainer, bad)
        self.resume_report["fingerprint_ok"] = not bad
        if bad:
            self._refuse_or_warn([f"fingerprint after restore: {line}" for line in bad])

    def _refuse_or_warn(self, differences: list[str]) -> None:
        if self.strict:
            source = self._trainer.ckpt_path if self._trainer is not None else None
            raise ResumeMismatchError(
                str(source or "the checkpoint"),
                differences,
                "Fix the run to match the checkpoint, or pass ExactResume(strict=False) to continue approximately.",
            )
        rank_zero_warn(
            "ExactResume(strict=False): resuming approximately; these will not be exact:\n"
            + "\n".join(f"  - {d}" for d in differences)
        )

    # ----------------------------------------------------------------------------------- schedule
    def _start_schedule(self, trainer: "pl.Trainer", pending: Mapping[str, Any]) -> None:
        assert self.scheduler is not None
        self.scheduler.start(
            step=trainer.global_step,
            num_nodes=self._num_nodes or trainer.num_nodes,
            history_dir=snapshots.snapshot_dir(trainer) if self.scheduler.takes_snapshots else None,
            restored=pending.get("schedule"),
            checkpoint_wall_time=pending.get("saved_at"),
            is_rank_zero=trainer.is_global_zero,
        )

    def _scheduled_snapshot(self, trainer: "pl.Trainer") -> None:
        """At an optimizer-step boundary: save if the schedule or a preemption signal says so.

        One process acts on its own flag at once; ranks agree at check steps only (rank 0's decision,
        any rank's signal), so no collective runs between checks.
        """
        assert self.scheduler is not None
        local_preempt = self.preemption is not None and self.preemption.requested
        if local_preempt and trainer.world_size == 1:
            save, preempt, reason = False, True, "preemption"
        else:
            agree = lambda values: ranks.max_over_ranks(trainer, values)  # noqa: E731
            save, preempt, reason = self.scheduler.decide(trainer.global_step, local_preempt, agree, trainer.is_global_zero)
        if save or preempt:
            self._snapshot(trainer, "preemption" if preempt else reason)
        if preempt:
            self.preempted = True
            self.scheduler.clean_stop(trainer.is_global_zero)
            trainer.should_stop = True
            rank_zero_info(f"ExactResume: preemption signal received; snapshot at step {trainer.global_step} is durable; stopping.")

    def _snapshot(self, trainer: "pl.Trainer", reason: str) -> None:
        started = time.monotonic()
        path = snapshots.save_snapshot(trainer, reason)
        blocked = time.monotonic() - started  # with an async writer: the snapshot part only
        writer = snapshots.async_writer(trainer)
        if reason == "preemption" and writer is not None:
            snapshots.wait_durable(writer, path)
        if self.scheduler is None or self.scheduler.state is None:
            return
        nbytes = os.path.getsize(path) if trainer.is_global_zero and os.path.isfile(path) else None
        metrics = self.scheduler.record(trainer.global_step, blocked, nbytes, writer)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def _warn_about_loaders(self, trainer: "pl.Trainer") -> None:
        for i, loader in enumerate(lt.train_loaders(trainer)):
            for problem in loader_problems(f"train loader {i}", loader):
                rank_zero_warn(f"ExactResume: resume will not be exact: {problem}")


def _make_scheduler(
    mtbf: Optional[Duration], num_nodes: Optional[int], formula: str, min_interval: Duration,
    max_interval: Duration, every_n_train_steps_max: Optional[int], mtbf_prior: Optional[Duration],
    initial_cost: Duration, check_interval: Duration, clock: Optional[Callable[[], float]], checks_needed: bool,
) -> Optional[SnapshotScheduler]:
    """The scheduler, also without snapshots (``mtbf=None``, no step cap) when preemption signals need
    its cadence of rank-agreed checks; ``None`` when there is nothing to decide."""
    if mtbf is None and every_n_train_steps_max is None and not checks_needed:
        return None
    config = ScheduleConfig.from_user(
        mtbf=mtbf, num_nodes=num_nodes or 1, formula=formula, min_interval=min_interval,
        max_interval=max_interval, every_n_train_steps_max=every_n_train_steps_max,
        initial_cost=initial_cost, mtbf_prior=mtbf_prior, check_interval=check_interval,
    )
    return SnapshotScheduler(config, clock or time.monotonic)


