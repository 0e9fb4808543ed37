"""ExactResume: the Lightning hooks that make every checkpoint resume bit for bit.

Thin by design: each hook gathers its inputs and calls one module. ``capture`` builds the state a
checkpoint gets (every rank's RNG streams, data position, fingerprint); ``restore`` applies it at
``on_train_start``, the one moment that makes the next step identical to the uninterrupted run's;
``driver`` runs the snapshot schedule and preemption stops; ``snapshots`` decides where a snapshot goes.
With ``LIGHTNING_RESUME_TRACE`` set (by ``lightning-resume prove``), the hooks also hand their moments to
``prove.trace``'s recorder; without it there is none. Lightning internals are in ``lightning_resume._compat.lightning``.
"""

import signal
import time
from typing import Any, Callable, Mapping, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_resume._compat import check_versions
from lightning_resume._compat import lightning as lc
from lightning_resume._compat.botocore import isolate_retry_jitter
from lightning_resume._compat.lightning_warnings import quiet_last_hint_for_resolvers
from lightning_resume.durations import Duration
from lightning_resume.errors import ConfigurationError, ExactResumeWarning
from lightning_resume.exact import driver, evidence, lightning_gaps, snapshots
from lightning_resume.exact import elastic as elastic_restore
from lightning_resume.exact.capture import (
    AT_STEP_BOUNDARY,
    INSIDE_STEP,
    INSIDE_VALIDATION,
    OUTSIDE_FIT,
    checkpoint_state,
)
from lightning_resume.exact.elastic import Afterwards, ElasticMode
from lightning_resume.exact.notices import NoticeWatch
from lightning_resume.exact.own_checkpoints import (
    BEFORE_TRAINING,
    OwnCheckpoints,
    check_trainer,
    has_position,
    without_position,
)
from lightning_resume.exact.restore import (
    LoadedDigests,
    ResumeReport,
    as_launched,
    check_same_checkpoint,
    loaded_digests,
    restore,
    warn_approximate,
)
from lightning_resume.exact.state import fingerprint as fingerprints
from lightning_resume.exact.state import rng as rng_streams
from lightning_resume.exact.state.data import AdoptedLoaders
from lightning_resume.exact.state.user import (
    UserState,
    find_in_fit,
    put_back_later,
    registration_problems,
    user_state_digests,
)
from lightning_resume.exact.state.user import capture as capture_user_state
from lightning_resume.format.partial import refuse_partly_loaded
from lightning_resume.io.plugin import refuse_at_fit_start
from lightning_resume.memory.store import ROOT_KEY, RUN_KEY
from lightning_resume.memory.tier import DURABLE, MemoryTier, unsupported, warn_sharded
from lightning_resume.protocols import loaded_in_place, offer_module
from lightning_resume.prove import trace
from lightning_resume.retention.last import OncePerFit, resumed_from
from lightning_resume.schedule.config import DEFAULT_MTBF, ScheduleConfig
from lightning_resume.schedule.options import MemoryTierOptions, PreemptionOptions, ScheduleOptions, resolve
from lightning_resume.schedule.preemption import PreemptionFlag

NOT_RESTORED_WITHOUT_EXACT_RESUME = (
    "RNG streams (Python, NumPy, torch CPU/CUDA, registered generators), the data position aligned with"
    " the last trained batch, loader worker RNG, validation due at the saved step"
)


class ExactResume(Callback):
    """Make every checkpoint the trainer writes resumable bit for bit, and take snapshots on the
    optimal schedule.

    Options come as a few top-level values and one typed group per concern; in LightningCLI YAML each
    group is a nested mapping (``schedule: {min_interval: 5min}``).

    Args:
        mtbf: mean time between failures of one node. ``"observed"`` (default) learns it from this run's
            failure history, starting from ``schedule.mtbf_prior``. A fixed MTBF is ``"24h"``, seconds or a
            ``timedelta``. Snapshots come every T* = sqrt(2 C M): C is a save's measured blocking time, M the
            MTBF over the nodes. ``None`` takes no scheduled snapshots; every other checkpoint stays exact.
        schedule: how the snapshot interval is computed and bounded (``ScheduleOptions``): the formula, the
            node count, the interval bounds, a step cap, the MTBF prior, the first cost guess, the decision cadence.
        memory_tier: ``MemoryTierOptions`` keeps each rank's newest snapshot in shared memory too (YAML:
            ``memory_tier: {}``). It outlives a crashed or killed process while the machine lives.
            ``fit(ckpt_path="last")`` resumes from it when it is newer than the newest verified checkpoint on
            disk. ``None`` (default) turns the tier off. Single-device and DDP runs (README, "Memory tier").
        preemption: what asks for a durable snapshot and a clean stop at the next step boundary
            (``PreemptionOptions``): signals (SIGTERM and SIGUSR1 by default) and cloud notices (off by
            default; README, "Spot and preemptible instances"). ``None`` leaves signals alone and polls nothing.
        elastic: resume a checkpoint written on W ranks on W' (DDP; sharded strategies reshard the weights).
            The samples of the interrupted epoch no old rank trained are dealt to the new ranks, so each
            sample of the epoch is trained once; later epochs use the sampler's order for W'. New rank ``r``
            starts from saved rank ``r % W``'s RNG streams, re-seeded from a digest of them when ``r >= W``.
            ``True`` keeps the per-rank batch; ``"keep_global_batch"`` scales ``accumulate_grad_batches`` by
            W / W' (refused when it does not divide). Needs one map-style train loader with a distributed
            sampler. ``resume_report`` says ``exact: False`` and ``sample_exact: True``. Without it (default)
            another world size is refused.
        strict: if ``True`` (default), a checkpoint that does not fit this run raises ``ResumeMismatchError``:
            another world size without ``elastic``, another loader configuration, dataset length, model or
            optimizer structure, or a fingerprint that does not match after restore. If ``False``, training
            continues approximately and a warning lists what will not be exact.
        fingerprint: record digests (xxh3-128) of RNG and data state, weights and optimizer state in each
            checkpoint, and check them after restore. With ``SafetensorsCheckpointIO`` the file's own tensor
            digests stand in for hashing at save; elsewhere, one pass of hashing per save.
        state: objects to save and restore by name beyond those found automatically (README, "State you keep
            yourself"): anything with ``state_dict()``/``load_state_dict()``, or a ``torch.Generator``,
            ``numpy.random.Generator``, ``numpy.random.RandomState`` or ``random.Random``. The automatic walk
            from the module, the datamodule and the train datasets finds LR schedulers not given to Lightning,
            torchmetrics metrics, such objects and generators. Each restored one is named in
            ``resume_report["user_state"]``.
    """

    def __init__(
        self,
        mtbf: Optional[Duration] = DEFAULT_MTBF,
        schedule: ScheduleOptions = ScheduleOptions(),  # noqa: B008  (frozen: one shared default is safe)
        memory_tier: Optional[MemoryTierOptions] = None,
        preemption: Optional[PreemptionOptions] = PreemptionOptions(),  # noqa: B008
        elastic: ElasticMode = False,
        strict: bool = True,
        fingerprint: bool = True,
        state: Optional[dict[str, Any]] = None,
    ) -> None:
        check_versions()
        lc.resolve_last_through_callbacks()  # fit(ckpt_path="last"): the newest verified checkpoint of any callback
        quiet_last_hint_for_resolvers()  # ... and Lightning's hint to set save_last=True, which that makes wrong
        isolate_retry_jitter()  # a retried S3 request must not draw from the random stream this callback saves
        options = resolve(mtbf, schedule, memory_tier, preemption)  # every group's problems, each named by its path
        problems = [*options.problems, *elastic_restore.check_mode(elastic), *registration_problems(state)]
        if problems or options.schedule is None:
            raise ConfigurationError("ExactResume", problems)
        self.memory = MemoryTier(memory_tier.dir, memory_tier.replicas) if memory_tier is not None else None
        if memory_tier is not None:
            lc.remember_ckpt_path_requests()  # fit(ckpt_path="last") considers the memory tier first
        self.state: dict[str, Any] = dict(state or {})
        self._user: Optional[UserState] = None  # what this fit saves beyond Lightning, found at train start
        self._user_again: Optional[Callable[[], None]] = None  # undoes on_train_start hooks run after the restore
        self.strict = strict
        self.fingerprint = fingerprint
        self.elastic: ElasticMode = elastic
        self._afterwards = Afterwards()
        self._loaded: Optional[LoadedDigests] = None
        signals = preemption.signals if preemption is not None else None
        self.preemption = PreemptionFlag(signals) if signals else None
        self.notices = (
            NoticeWatch(
                preemption.notices,
                preemption.on_notice,
                preemption.endpoint,
                preemption.dmi_dir,
                options.poll_interval_s,
            )
            if preemption is not None and preemption.notices
            else None
        )
        self._schedule: ScheduleConfig = options.schedule
        self._set_clocks()
        self._num_nodes = schedule.num_nodes
        self.preempted = False
        self._trainer: Optional[pl.Trainer] = None
        self._pending: Optional[dict[str, Any]] = None
        self._after_batch = False
        self._staging_reserved = False
        self._in_validation = False
        self._requeue_signal: Optional[signal.Signals] = None
        self._stop_replacing_loaders: Optional[Callable[[], None]] = None
        self.resume_report = ResumeReport()
        self._last = OncePerFit()
        self._trace: Optional[trace.TraceRecorder] = None
        self._own = OwnCheckpoints()  # the Tuner's save and restore are not checkpoints of the run

    def _set_clocks(
        self, clock: Optional[Callable[[], float]] = None, wall_clock: Optional[Callable[[], float]] = None
    ) -> None:
        """The clocks the schedule reads: monotonic ``clock`` for intervals, ``wall_clock`` (seconds since the
        epoch) for the failure history and each checkpoint's date. ``time``'s by default; fake ones only through
        the tests' seam (``tests/helpers/clocks.py``), never an option."""
        self._wall_clock = wall_clock or time.time
        checks = self.preemption is not None or self.notices is not None
        self.scheduler = driver.make_scheduler(self._schedule, clock, self._wall_clock, checks)

    @property
    @override
    def state_key(self) -> str:
        return "ExactResume"

    @property
    def resolves_last(self) -> bool:
        """``ckpt_path="last"`` is the newest checkpoint of any of the trainer's checkpoint callbacks that
        verifies, by training progress (``retention.last``), not Lightning's newest ``last*.ckpt``."""
        return True

    def resolve_last(self, trainer: pl.Trainer) -> set[str]:
        return self._last.resolve(trainer)

    def resumes_from_memory_first(self, trainer: pl.Trainer) -> bool:
        """``fit(ckpt_path="last")`` with the memory tier, on a strategy it supports: "last" reads the durable
        checkpoints' headers only, the rest only if the memory tier does not supply the resume (``MemoryFirst``)."""
        return self.memory is not None and lc.requested_ckpt_path(trainer) == "last" and not unsupported(trainer)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_trainer(trainer)  # a pytorch_lightning.Trainer is refused, naming the import that fixes it
        self._trainer = trainer
        self._last.clear()  # Lightning's "last" search is over: the next fit resolves afresh
        if stage == "fit":
            offer_module(trainer, pl_module)  # the restore that follows reads the weights into it
            refuse_at_fit_start(trainer, pl_module)  # not at the first save, hours in
        if stage == "fit":
            self._trace = self._trace_from_environment(trainer)
            self._own.setup(trainer)
        if stage == "fit" and self._stop_replacing_loaders is None:
            # The loaders users already have, made resumable in place as Lightning sets them up; put back at the end.
            adopted = AdoptedLoaders()
            self._stop_replacing_loaders = lc.on_train_loader_processed(trainer, adopted, adopted.release)
        if snapshots.snapshot_target(trainer) is None and snapshots.first_model_checkpoint(trainer) is None:
            if self.scheduler is not None and self.scheduler.config.asked_for_snapshots:
                raise ConfigurationError("ExactResume", [
                    "scheduled snapshots need a checkpoint directory: add a RetentionCheckpoint or"
                    " ModelCheckpoint, or pass mtbf=None and leave schedule.every_n_train_steps_max unset"
                ])  # fmt: skip
            # A run that writes no checkpoints loses nothing by taking no snapshots: said once, not warned.
            if self.scheduler is not None and self.scheduler.takes_snapshots:
                rank_zero_info("ExactResume: no checkpoint callback, so no scheduled snapshots are taken")
                self.scheduler = None
            if self.preemption is not None:
                rank_zero_info("ExactResume: no checkpoint callback; preemption signals keep their usual behaviour")
                self.preemption = None
            if self.notices is not None:
                rank_zero_info("ExactResume: no checkpoint callback, so no preemption notices are watched")
                self.notices = None
        if self.memory is not None and stage == "fit":
            if warn_sharded(trainer):
                self._drop_memory_tier()
            else:
                self.memory.setup(trainer, snapshots.snapshot_dir(trainer))

    def _trace_from_environment(self, trainer: pl.Trainer) -> Optional[trace.TraceRecorder]:
        """The recorder ``lightning-resume prove`` asks for, read once per fit (``None``: nothing is recorded)."""
        capture = rng_streams.capture_rng  # the streams a checkpoint saves
        components = lambda: user_state_digests(capture_user_state(self._user))  # found at train start
        return trace.from_environment(
            trainer.global_rank, fingerprints.digest, capture, clock=self._wall_clock, components=components
        )

    def _drop_memory_tier(self) -> None:
        """No memory tier after all (a sharded run): the schedule becomes single-level, as it decides alone."""
        self.memory, old = None, self.scheduler
        if old is not None:
            checks = self.preemption is not None or self.notices is not None
            self.scheduler = driver.make_scheduler(old.config.single_level(), old.clock, old.wall_clock, checks)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        offer_module(trainer, None)  # the restore is over: no later load may read into the live module
        refuse_partly_loaded(trainer)  # not on weights an earlier failed load left half-written (format.partial)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loaders = lc.train_loaders(trainer)
        unsaved_found = evidence.unsaved_positions(loaders)
        unsaved = [finding.line for finding in unsaved_found]
        resuming = self._pending is not None
        roots = self._roots(trainer, pl_module, loaders)
        self._user = find_in_fit(trainer, roots, self.state)
        # A fresh run is never refused: each loader whose position is unsaved is named once, after the rest.
        found = self._what_cannot_be_exact(trainer, loaders, roots)
        warned = [finding.line for finding in found]
        warned += [] if resuming else [f"resume will not be exact: {line}" for line in unsaved]
        for problem in warned:
            rank_zero_warn(f"ExactResume: {problem}", category=ExactResumeWarning)
        if unsaved and resuming:  # a position this loader cannot take: resumed as Lightning does
            warn_approximate(unsaved)
        pending, self._pending = self._pending, None
        check_same_checkpoint(trainer, pending)
        report = ResumeReport()
        if pending is not None:
            report, self._afterwards = restore(
                trainer, pending, self.strict, self.fingerprint, self.elastic, self._loaded, self._user
            )
            self._loaded = None
            self._user_again = put_back_later(self._user)
        self._own.train_started(trainer, resumed_every_loader=pending is not None and not unsaved)
        tier = self._resumed_tier(trainer, pending)
        sources = None if self.memory is None else self.memory.sources
        self.resume_report = as_launched(report, resumed_from(trainer), tier, self.memory is not None, unsaved, sources)
        if self._trace is not None:  # after the restore: the step this launch resumed at
            unsaved_buffers = list(self.resume_report.unsaved_buffers_differ)
            buffers = [f"non-persistent buffers {unsaved_buffers} differ after restore"] if unsaved_buffers else []
            restored = evidence.after_restore(trainer, pending, self.resume_report, unsaved)
            self._trace.start(
                trainer,
                self.resume_report.exact,
                [*warned, *self.resume_report.differences, *buffers],
                [*found, *unsaved_found, *restored],
            )
        if self.scheduler is not None:
            driver.start(self.scheduler, trainer, self._num_nodes, pending or {}, tier, self.memory)
        if self.preemption is not None:
            self._take_over_slurm_requeue(trainer)
            self.preemption.install()  # after Lightning's own SIGTERM handler (trainer.py:1074), replacing it
        if self.notices is not None:
            clouds = self.notices.start(self._wall_clock)
            if clouds:
                rank_zero_info(f"ExactResume: watching {', '.join(clouds)} preemption notices")

    def _resumed_tier(self, trainer: pl.Trainer, pending: Optional[dict[str, Any]]) -> Optional[str]:
        """``"memory"`` or ``"durable"``: where this run resumed from (``None``: a fresh start)."""
        if self.memory is None:
            return DURABLE if trainer.ckpt_path else None
        restored = pending or {}  # the run's id and snapshot root; a snapshot of a line left behind dropped
        self.memory.start(restored.get(RUN_KEY), restored.get(ROOT_KEY))
        return self.memory.resumed_tier or (DURABLE if trainer.ckpt_path else None)

    def _what_cannot_be_exact(
        self, trainer: pl.Trainer, loaders: list, roots: dict[str, Any]
    ) -> list[evidence.Finding]:
        """One finding (its kind, subject and line) per loader configuration, unsaved random stream, state that
        cannot be saved or launcher setting that defeats exactness."""
        user = self._user or UserState()
        saved = [held.obj for held in user.held]
        return evidence.cannot_be_exact(trainer, loaders, roots, saved, user.refused)

    @staticmethod
    def _roots(trainer: pl.Trainer, pl_module: pl.LightningModule, loaders: list) -> dict[str, Any]:
        """Where state that training changes lives: the module, the datamodule, each train loader's dataset."""
        # Trainer.datamodule and .callbacks are public but assigned by Lightning's connectors, so untyped
        roots = {"model": pl_module, "datamodule": trainer.datamodule}  # type: ignore[attr-defined]
        datasets = {f"train loader {i} dataset": getattr(dl, "dataset", None) for i, dl in enumerate(loaders)}
        roots.update({name: ds for name, ds in datasets.items() if ds is not None})  # a generator has none
        return roots

    def _take_over_slurm_requeue(self, trainer: pl.Trainer) -> None:
        """On SLURM with ``auto_requeue``, Lightning saves mid-step from its handler of the requeue signal and
        requeues the job; that signal becomes a preemption (snapshot at the next step boundary, then requeue)."""
        assert self.preemption is not None
        self._requeue_signal = lc.slurm_requeue_signal(trainer)
        if self._requeue_signal is not None and self._requeue_signal not in self.preemption.signals:
            self.preemption = PreemptionFlag((*self.preemption.signals, self._requeue_signal))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.scheduler is not None:
            self.scheduler.clean_stop()
        if self.memory is not None:
            self.memory.free()  # a clean end: the durable tier holds the final state
        snapshots.remove_superseded(trainer)  # a snapshot a newer checkpoint of the user's holds leaves no file
        if self._trace is not None:
            self._trace.end(trainer, snapshots.snapshot_files(trainer), snapshots.retention_files(trainer))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._give_back_hooks()

    def _give_back_hooks(self) -> None:
        self._own.release()
        self._afterwards.teardown()  # samplers an elastic resume planned get their own class back
        if self.memory is not None:
            self.memory.teardown()  # the snapshots stay after an exception: the next process resumes from them
        if self.preemption is not None:
            self.preemption.uninstall()
        if self.notices is not None:
            self.notices.stop()
        if self._stop_replacing_loaders is not None:
            self._stop_replacing_loaders()
            self._stop_replacing_loaders = None
        if self._trace is not None:
            self._trace.close()
            self._trace = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning does not call ``teardown`` on callbacks after an exception: give the signals back now.
        self._give_back_hooks()
        if self.memory is not None:
            self.memory.flush()  # the newest memory snapshot is what the relaunch after this failure resumes from

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._after_batch = False
        put_back, self._user_again = self._user_again, None
        if put_back is not None:  # the module's on_train_start ran after the restore (it may reset them)
            put_back()
        if self._trace is not None:
            self._trace.batch_start(trainer, batch)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._after_batch = True
        if self._trace is not None:  # first: a checkpoint this batch end takes comes after its records
            self._trace.batch_end(trainer, outputs, batch_idx)
        if not self._staging_reserved and lc.at_optimizer_step(trainer):
            self._staging_reserved = True  # the optimizer state exists now: size the first save's staging
            snapshots.reserve_staging(trainer)
        if self.scheduler is not None and lc.at_optimizer_step(trainer):
            with trace.timed_saves(self._trace):  # a save here comes at a step the clock chose
                stop = driver.at_step_boundary(
                    self.scheduler, self.preemption, trainer, self._requeue_signal, self.memory, self.notices
                )
            self.preempted = stop or self.preempted

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._after_batch = False
        self._in_validation = True
        if self._trace is not None:
            self._trace.validation_start(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._in_validation = False  # Lightning runs checkpoint callbacks' on_validation_end after this one
        if self._trace is not None:
            self._trace.validation_end(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._after_batch = False
        self._afterwards.epoch_ended()  # an elastic resume's epoch length: the next epoch is Lightning's own
        lightning_gaps.at_epoch_end(trainer)  # a resumed epoch's plateau schedulers step as the others'

    @override
    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        if trainer is None or not trainer.training and not trainer.validating:
            return {"captured_at": OUTSIDE_FIT}  # trainer.save_checkpoint() after fit: no training position
        if self._own.before_training(trainer):
            return {"captured_at": BEFORE_TRAINING}  # the Tuner's save at fit start: no training position yet
        if self.memory is None or not self.memory.dumping:  # a durable save: rank 0's previous write must end
            snapshots.wait_for_previous_write(trainer)
        schedule = self.scheduler.state_dict() if self.scheduler is not None else {}
        where = INSIDE_STEP if lc.inside_training_step(trainer) else AT_STEP_BOUNDARY
        where = INSIDE_VALIDATION if self._in_validation and not trainer.sanity_checking else where
        now = self._wall_clock()  # the failure history's clock: a resume's lost time is measured on it
        state = checkpoint_state(trainer, self._after_batch, self.fingerprint, schedule, where, now, self._user)
        if self.memory is not None and self.memory.run is not None:
            state[RUN_KEY] = self.memory.run  # names the run whose memory snapshots a relaunch may resume
            if self.memory.root_token is not None:  # and, when our root's name was squatted, where they are
                state[ROOT_KEY] = self.memory.root_token
        if self._trace is not None:  # every checkpoint of the fit, on every rank (validation's saves included)
            self._trace.saved(trainer)
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._own.restoring(self._trainer):
            return  # the Tuner restoring its own save: no resume, and a resume still to apply stays
        self._pending = state_dict if has_position(state_dict) else None

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._own.restoring(trainer):
            return  # the Tuner restoring its own save: Lightning's restore, untouched, as without ExactResume
        ours = checkpoint.get("callbacks", {}).get(self.state_key)
        if has_position(ours):
            lc.drop_loader_state(checkpoint)  # ExactResume applies its own aligned positions (none outside fit)
        if not trainer.training:
            return  # validate/test/predict read weights only: nothing of a training position is missed
        self._loaded = None
        if self.fingerprint and ours and _weights_left_to_the_file(ours):
            # once per resume, while Lightning still holds the dict
            in_place = loaded_in_place(trainer) if self.memory is None else self.memory.loaded_in_place(trainer)
            self._loaded = loaded_digests(checkpoint, in_place)
        if not ours:
            rank_zero_warn(
                "ExactResume: this checkpoint was written without ExactResume; training resumes but these are not"
                f" restored: {NOT_RESTORED_WITHOUT_EXACT_RESUME}. The resumed run will differ from an"
                " uninterrupted one.",
                category=ExactResumeWarning,
            )
        elif not has_position(ours):
            rank_zero_warn(
                f"ExactResume: this checkpoint was {without_position(ours.get('captured_at'))}, so"
                f" it holds no training position; training resumes but these are not restored:"
                f" {NOT_RESTORED_WITHOUT_EXACT_RESUME}.",
                category=ExactResumeWarning,
            )


def _weights_left_to_the_file(state: dict[str, Any]) -> bool:
    """Whether a rank's saved fingerprint left the weights to the file's own digests (``capture.files_prove_tensors``)."""
    ranks = state.get("ranks")
    prints = [r.get("fingerprint") for r in ranks if isinstance(r, Mapping)] if isinstance(ranks, list) else []
    return any(isinstance(p, Mapping) and "weights" not in p for p in prints)  # a malformed state: restore names it
