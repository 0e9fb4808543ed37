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
from typing import Any, Callable, Literal, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_resume._compat import check_versions
from lightning_resume._compat import lightning as lc
from lightning_resume._compat.botocore import isolate_retry_jitter
from lightning_resume._compat.lightning_warnings import quiet_last_hint_for_resolvers
from lightning_resume.durations import Duration, parse_duration
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
from lightning_resume.exact.notices import DMI_DIR, NoticeSpec, NoticeWatch, notice_problems
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
from lightning_resume.io.plugin import refuse_unencodable_hparams
from lightning_resume.memory.store import DEFAULT_MEMORY_DIR, RUN_KEY
from lightning_resume.memory.tier import DURABLE, MemoryTier, warn_sharded
from lightning_resume.protocols import loaded_in_place, offer_module
from lightning_resume.prove import trace
from lightning_resume.retention.last import OncePerFit, resumed_from
from lightning_resume.schedule.config import (
    DEFAULT_CHECK_INTERVAL,
    DEFAULT_INITIAL_COST,
    DEFAULT_MAX_INTERVAL,
    DEFAULT_MIN_INTERVAL,
    DEFAULT_MTBF,
    DEFAULT_MTBF_PRIOR,
    DEFAULT_PROCESS_MTBF_PRIOR,
    MtbfMode,
    ScheduleConfig,
)
from lightning_resume.schedule.preemption import DEFAULT_SIGNALS, PreemptionFlag

NOT_RESTORED_WITHOUT_EXACT_RESUME = (
    "RNG streams (Python, NumPy, torch CPU/CUDA, registered generators), the data position aligned with"
    " the last trained batch, loader worker RNG, validation due at the saved step"
)


def _memory_schedule(memory_tier: bool, process_mtbf: Optional[Duration], every: Optional[int]) -> dict[str, Any]:
    """The schedule's memory-tier options: the tier on with neither option set is paced by an observed
    process MTBF (1 h prior); a step cap alone stays a pure step cap. Without the tier the options are
    passed as given, so that a bad value is reported with the rest (and one given at all, by
    ``_memory_tier_problems``)."""
    if memory_tier and process_mtbf is None and every is None:
        process_mtbf = MtbfMode.OBSERVED.value
    prior = DEFAULT_PROCESS_MTBF_PRIOR if process_mtbf == MtbfMode.OBSERVED.value else None
    return {"process_mtbf": process_mtbf, "memory_every_n_train_steps_max": every, "process_mtbf_prior": prior}


def _memory_tier_problems(
    memory_tier: bool, process_mtbf: Optional[Duration], memory_dir: Optional[str], every: Optional[int]
) -> list[str]:
    """What is wrong with the memory tier's own options (the schedule's are ``ScheduleConfig``'s to check)."""
    problems = []
    if not isinstance(memory_tier, bool):
        problems.append(f"memory_tier={memory_tier!r} must be True or False")
    if not memory_tier:
        given = {"process_mtbf": process_mtbf, "memory_dir": memory_dir, "memory_every_n_train_steps_max": every}
        problems += [f"{k}={v!r} configures the memory tier; pass memory_tier=True" for k, v in given.items() if v]
    if memory_dir is not None and "://" in str(memory_dir) and not str(memory_dir).startswith("file://"):
        problems.append(f"memory_dir={memory_dir!r} must be a local (tmpfs) directory such as /dev/shm/...")
    return problems


class ExactResume(Callback):
    """Make every checkpoint the trainer writes resumable bit for bit, and take snapshots on the
    optimal schedule.

    Args:
        generators: extra ``torch.Generator`` objects to save and restore, by name
            (e.g. a generator your augmentation draws from).
        strict: if ``True`` (default), a checkpoint that does not fit this run (world size without
            ``elastic``, loader configuration, dataset length, model or optimizer structure, a fingerprint
            that does not match after restore) raises ``ResumeMismatchError``. If ``False``, training
            continues approximately and a warning lists what will not be exact (another world size is
            then dealt out as with ``elastic=True`` where it can be).
        fingerprint: record digests (xxh3-128) of RNG and data state, and of weights and optimizer state, in
            each checkpoint and check them after restore. With ``SafetensorsCheckpointIO`` the weights and
            optimizer state are not hashed at save (the file records and verifies each tensor's digest): the
            restored state is compared with the loaded checkpoint, once per resume. With another checkpoint
            IO, one pass of hashing over the state at each save.
        mtbf: mean time between failures of one node: ``"observed"`` (default) estimates it from
            this run's failure history (kept in every checkpoint, extended at every start) with
            ``mtbf_prior`` as the prior; or a fixed ``"24h"``, seconds or ``timedelta``. Snapshots
            are taken every T* = sqrt(2 C M) (Young; ``formula="daly"`` for Daly's refinement), C
            being the measured blocking time of a save and M = mtbf / nodes. ``None`` takes no
            scheduled snapshots; every other checkpoint stays exact.
        num_nodes: nodes sharing the failure rate (default: the trainer's ``num_nodes``).
        min_interval, max_interval: bounds on the interval between snapshots.
        every_n_train_steps_max: take a snapshot at least every this many optimizer steps.
        mtbf_prior: the prior per-node MTBF for ``mtbf="observed"`` (default ``"30d"``; the README
            explains the choice from public failure data).
        initial_cost: conservative guess of C before the first measurement (the first snapshot
            comes after ``min_interval`` to measure it).
        check_interval: longest time between two schedule decisions; also bounds how late a
            preemption signal is acted on in multi-process runs.
        preemption_signals: signals that request a snapshot and a clean stop at the next step
            boundary (the handler only sets a flag). ``None`` or ``[]`` leaves signals alone.
        clock: monotonic clock in seconds (tests pass a fake one).
        wall_clock: wall clock in seconds since the epoch (default ``time.time``; tests pass a fake one):
            it dates each checkpoint and the failure history, which span processes.
        memory_tier: also keep the newest full snapshot of each rank in shared memory (``memory_dir``),
            which outlives a crashed or killed process while the machine lives: ``fit(ckpt_path="last")``
            resumes from it when it is newer than the newest verified durable checkpoint and every rank
            holds the same step (else from disk, on every rank). Snapshots are taken on the two-level
            schedule (README, "Memory tier"); the memory is given back at a clean end of training.
            Single-device and DDP runs.
        process_mtbf: mean time between failures that keep the machine (a crash, an OOM kill, a
            deploy): ``"1h"``, seconds, ``timedelta``, or ``"observed"`` (learnt from the failure history,
            where a resume from memory counts as one); with ``mtbf`` (the failures that lose it), it sets
            the interval of each tier. ``None`` (default): ``"observed"`` with a 1 h prior
            (``DEFAULT_PROCESS_MTBF_PRIOR``), unless ``memory_every_n_train_steps_max`` alone paces the tier.
        memory_dir: the tmpfs for ``memory_tier`` (default ``/dev/shm``), a local path: snapshots live in this
            user's own root under it, ``<memory_dir>/lightning-resume-<uid>`` (mode 0700, checked before each
            use; one that is another user's or open to others is refused with a warning, the tier off).
        memory_every_n_train_steps_max: take a memory snapshot at least every this many optimizer steps.
        preemption_notices: act on the notice a spot or preemptible instance gets before it goes, as on a
            preemption signal: ``"auto"`` polls the metadata endpoint of the cloud this machine's DMI
            evidence shows (AWS, Google Cloud, Azure; on any other machine nothing starts and no socket
            opens), or a list such as ``["aws"]``; ``None`` (default) polls nothing. Each rank polls on a
            daemon thread every ``notice_interval``; a notice on any rank stops every rank at the same step,
            after a durable snapshot (README, "Spot and preemptible instances").
        on_notice: ``"stop"`` (default): snapshot, then stop cleanly; ``"snapshot"``: snapshot and keep
            training until the signal comes.
        notice_endpoint: base URL of the metadata service instead of the cloud's own (a proxy, a test server).
        notice_interval: time between two polls (default ``"5s"``).
        notice_dmi_dir: where the DMI evidence for ``"auto"`` is read (default ``/sys/class/dmi/id``).
        elastic: resume a checkpoint written on W ranks on W' (DDP; sharded strategies reshard the weights):
            the samples of the interrupted epoch no old rank trained are dealt to the new ranks so that every
            sample of the epoch is trained once (padding to an equal count per rank repeats a few, as
            ``DistributedSampler`` does; its ``drop_last=True`` leaves them out instead); later epochs use the
            sampler's order for W'. New rank ``r`` starts from saved rank ``r % W``'s RNG streams, re-seeded
            from a digest of them when ``r >= W``. ``True`` keeps the per-rank batch (the global batch
            changes); ``"keep_global_batch"`` scales ``accumulate_grad_batches`` by W / W' (refused when it does
            not divide). Needs one map-style train loader with a distributed sampler (Lightning's, or
            torchdata's ``StatefulDistributedSampler``). ``resume_report`` says ``exact: False``,
            ``sample_exact: True``, both world sizes and global batches; one warning says the same. Without
            it (default) another world size is refused.
        state: objects to save and restore by name beyond those found automatically (README, "State you keep
            yourself"): anything with ``state_dict()``/``load_state_dict()``, or a ``torch.Generator``,
            ``numpy.random.Generator``, ``numpy.random.RandomState`` or ``random.Random``. Found automatically,
            by a bounded walk from the module, the datamodule and the train datasets: LR schedulers not given
            to Lightning, torchmetrics metrics, such objects and generators; each restored one is named in
            ``resume_report["user_state"]``.
    """

    def __init__(
        self,
        generators: Optional[dict[str, torch.Generator]] = None,
        strict: bool = True,
        fingerprint: bool = True,
        mtbf: Optional[Duration] = DEFAULT_MTBF,
        num_nodes: Optional[int] = None,
        formula: Literal["young", "daly"] = "young",
        min_interval: Duration = DEFAULT_MIN_INTERVAL,
        max_interval: Duration = DEFAULT_MAX_INTERVAL,
        every_n_train_steps_max: Optional[int] = None,
        mtbf_prior: Optional[Duration] = DEFAULT_MTBF_PRIOR,
        initial_cost: Duration = DEFAULT_INITIAL_COST,
        check_interval: Duration = DEFAULT_CHECK_INTERVAL,
        preemption_signals: Optional[Sequence[str]] = DEFAULT_SIGNALS,
        clock: Optional[Callable[[], float]] = None,
        memory_tier: bool = False,
        process_mtbf: Optional[Duration] = None,
        memory_dir: Optional[str] = None,
        memory_every_n_train_steps_max: Optional[int] = None,
        wall_clock: Optional[Callable[[], float]] = None,
        preemption_notices: NoticeSpec = None,
        on_notice: Literal["stop", "snapshot"] = "stop",
        notice_endpoint: Optional[str] = None,
        notice_interval: Duration = "5s",
        notice_dmi_dir: str = DMI_DIR,
        elastic: ElasticMode = False,
        state: Optional[dict[str, Any]] = None,
    ) -> None:
        check_versions()
        lc.resolve_last_through_callbacks()  # fit(ckpt_path="last"): the newest verified checkpoint of any callback
        quiet_last_hint_for_resolvers()  # ... and Lightning's hint to set save_last=True, which that makes wrong
        isolate_retry_jitter()  # a retried S3 request must not draw from the random stream this callback saves
        problems = _memory_tier_problems(memory_tier, process_mtbf, memory_dir, memory_every_n_train_steps_max)
        try:
            interval_s = parse_duration(notice_interval, "notice_interval")
        except ValueError as err:
            problems.append(str(err))
            interval_s = 5.0
        problems += notice_problems(preemption_notices, on_notice, notice_endpoint, interval_s)
        problems += elastic_restore.check_mode(elastic)
        problems += registration_problems(state)
        try:  # the schedule's options, validated once (every problem with the memory tier's); passed on whole
            schedule = ScheduleConfig.from_user(
                mtbf=mtbf, num_nodes=num_nodes or 1, formula=formula, min_interval=min_interval,
                max_interval=max_interval, every_n_train_steps_max=every_n_train_steps_max, mtbf_prior=mtbf_prior,
                initial_cost=initial_cost, check_interval=check_interval,
                **_memory_schedule(memory_tier, process_mtbf, memory_every_n_train_steps_max),
            )  # fmt: skip
        except ConfigurationError as err:
            raise ConfigurationError("ExactResume", problems + err.problems) from None
        if problems:
            raise ConfigurationError("ExactResume", problems)
        self.memory = MemoryTier(memory_dir or DEFAULT_MEMORY_DIR) if memory_tier else None
        if memory_tier:
            lc.remember_ckpt_path_requests()  # fit(ckpt_path="last") considers the memory tier first
        self.generators: dict[str, torch.Generator] = dict(generators or {})
        self.state: dict[str, Any] = dict(state or {})
        self._user: Optional[UserState] = None  # what this fit saves beyond Lightning, found at train start
        self._user_again: Optional[Callable[[], None]] = None  # undoes on_train_start hooks run after the restore
        self.strict = strict
        self.fingerprint = fingerprint
        self.elastic: ElasticMode = elastic
        self._afterwards = Afterwards()
        self._loaded: Optional[LoadedDigests] = None
        self.preemption = PreemptionFlag(preemption_signals) if preemption_signals else None
        self.notices = (
            NoticeWatch(preemption_notices, on_notice, notice_endpoint, notice_dmi_dir, interval_s)
            if preemption_notices
            else None
        )
        self._wall_clock = wall_clock or time.time
        checks = self.preemption is not None or self.notices is not None
        self.scheduler = driver.make_scheduler(schedule, clock, self._wall_clock, checks)
        self._num_nodes = num_nodes
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

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_trainer(trainer)  # a pytorch_lightning.Trainer is refused, naming the import that fixes it
        self._trainer = trainer
        self._last.clear()  # Lightning's "last" search is over: the next fit resolves afresh
        if stage == "fit":
            offer_module(trainer, pl_module)  # the restore that follows reads the weights into it
            refuse_unencodable_hparams(trainer, pl_module)  # not at the first save, hours in
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
                    " ModelCheckpoint, or pass mtbf=None and leave every_n_train_steps_max unset"
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
        capture = lambda: rng_streams.capture_rng(self.generators)  # the streams a checkpoint saves
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

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loaders = lc.train_loaders(trainer)
        unsaved_found = evidence.unsaved_positions(loaders)
        unsaved = [finding.line for finding in unsaved_found]
        resuming = self._pending is not None
        roots = self._roots(trainer, pl_module, loaders)
        self._user = find_in_fit(trainer, roots, self.state, self.generators)
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
                trainer, pending, self.generators, self.strict, self.fingerprint, self.elastic, self._loaded, self._user
            )
            self._loaded = None
            self._user_again = put_back_later(self._user)
        self._own.train_started(trainer, resumed_every_loader=pending is not None and not unsaved)
        tier = self._resumed_tier(trainer, pending)
        self.resume_report = as_launched(report, resumed_from(trainer), tier, self.memory is not None, unsaved)
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
            driver.start(self.scheduler, trainer, self._num_nodes, pending or {}, tier)
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
        self.memory.start((pending or {}).get(RUN_KEY))  # the run's id; a snapshot of a line left behind dropped
        return self.memory.resumed_tier or (DURABLE if trainer.ckpt_path else None)

    def _what_cannot_be_exact(
        self, trainer: pl.Trainer, loaders: list, roots: dict[str, Any]
    ) -> list[evidence.Finding]:
        """One finding (its kind, subject and line) per loader configuration, unsaved random stream, state that
        cannot be saved or launcher setting that defeats exactness."""
        user = self._user or UserState()
        saved = [*self.generators.values(), *(held.obj for held in user.held)]
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
        state = checkpoint_state(
            trainer, self.generators, self._after_batch, self.fingerprint, schedule, where, now, self._user
        )
        if self.memory is not None and self.memory.run is not None:
            state[RUN_KEY] = self.memory.run  # names the run whose memory snapshots a relaunch may resume
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
            self._loaded = loaded_digests(checkpoint, loaded_in_place(trainer))
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
    return any("fingerprint" in r and "weights" not in r["fingerprint"] for r in state.get("ranks") or [])
