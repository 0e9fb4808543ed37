"""``SafetensorsCheckpointIO``: the Lightning ``CheckpointIO`` hook over ``write``, ``read``, ``verify``, ``resolve``.

Thin by design: it validates options, cleans stale temporaries in the directory of each save (in full at the
first, then only this host's of dead processes; never when only loading: a reader, such as an eval job, must not judge another process's save), and delegates. Its one decision is the "last" fallback: Lightning resolves ``ckpt_path="last"`` to the
newest ``last*.ckpt`` by mtime and hands that path to ``load_checkpoint``
(``lightning/pytorch/trainer/connectors/checkpoint_connector.py`` ``_parse_ckpt_path``); if that file
fails verification, the plugin loads the newest sibling checkpoint that verifies instead and warns
naming both. A file asked for by any other name is never substituted.

With ``save="async"`` or ``"overlapped"`` a save blocks only for the snapshot (``staging.async_save.AsyncSaver``):
the write, and every deletion after it, run in order on one worker; ``_commit`` is that write, the hook a
subclass extends to act around each background commit. The plugin also implements the seams other parts use
without naming it (``protocols``): verifying, resolving "last", async status, staging and lending, loading in
place. Failures reach the training thread at the
next save, ``wait`` or ``teardown``. ``teardown`` runs inside Lightning's exception handler too
(``lightning/pytorch/trainer/call.py`` ``_call_and_handle_interrupt``); there it flushes for at most
``flush_timeout`` and warns instead of raising, so the original exception is the one that propagates.
"""

import atexit
import logging
import os
import sys
import warnings
import weakref
from typing import Any, Dict, List, Literal, Optional, Sequence, Set, Tuple

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from lightning_resume._compat import check_versions
from lightning_resume._compat.lightning import resolve_last_through_callbacks, saves_directories
from lightning_resume.cas.gc import cleanup, remove_and_collect
from lightning_resume.cas.layout import BLOCKS
from lightning_resume.cas.refs import read_refs
from lightning_resume.cas.save import Lineage, commit_deduped
from lightning_resume.durations import Duration, parse_duration
from lightning_resume.errors import (
    HPARAMS_KEYS,
    AsyncWriteWarning,
    CheckpointCorruptError,
    ConfigurationError,
    PartialLoadError,
    SkippedCheckpointWarning,
)
from lightning_resume.format import hparams, partial, read, write
from lightning_resume.format.atomic import clean_stale_temporaries
from lightning_resume.format.integrity import ALGORITHMS, DEFAULT_ALGORITHM, Algorithm
from lightning_resume.io.options import DEFAULT_REMOTE, SAVE_MODES, WRITERS, RemoteOptions, SaveMode, WriterKind
from lightning_resume.io.resolve import (
    Skipped,
    is_last_name,
    newest_first,
    newest_verified,
    progress,
    siblings,
    warn_skipped,
)
from lightning_resume.io.verify import precheck, problem
from lightning_resume.io.verify import verify as verify_file
from lightning_resume.protocols import checkpoint_io_as
from lightning_resume.staging.async_save import AsyncSaver, commit_staged
from lightning_resume.staging.buffers import StagedTensors
from lightning_resume.staging.lending import Lending
from lightning_resume.storage import files as storage
from lightning_resume.storage.deadline import Deadline
from lightning_resume.storage.files import is_local

STATE_DICT = "state_dict"
"""Where Lightning keeps the module's weights in a checkpoint."""

log = logging.getLogger(__name__)


class SafetensorsCheckpointIO(CheckpointIO):
    """Pickle-free, atomic, checksummed checkpoints; reads legacy ``torch.save`` files weights-only.

    Args:
        verify: check every checksum when loading (on by default; ``False`` skips hashing the tensor
            bytes, the header is still fully validated).
        checksum: digest written into new files: ``"xxh3-128"`` (default: near memory speed, catches
            accidental damage), ``"crc32"`` (the earlier default, ~4x slower), ``"sha256"`` or ``"blake2b"``
            (collision-resistant). Each file records its own, so files written with any of them still load.
        fallback_to_verified: when a ``last*.ckpt`` file fails verification on load, load the newest
            sibling checkpoint that verifies (with a warning) instead of failing.
        mmap: load a local file's tensors as copy-on-write views of the file instead of copies: no extra
            memory and no read copy, but the file's disk space stays in use while any loaded tensor lives
            (the optimizer keeps its loaded moments for the whole run), even after the file is deleted. A
            load from a URL always copies.
        save: when a save copies the state, and so how long it blocks training (docs/async-saving.md).
            ``"sync"`` (default): the save returns once the file is durable. ``"async"``: the save copies the
            state into reusable host buffers and returns; the write runs in the background. ``"overlapped"``:
            the save copies only what the next forward may change; the weights and optimizer state are copied
            while the next forward and backward run, and the next optimizer step waits for that copy. Exact
            under the conditions in docs/async-saving.md, "Overlapped copy"; off by default for that reason.
            In the background modes at most one write is in flight (the next save waits for it), and
            deletions queue behind the writes before them.
        writer: where the write and its hashing run. ``"thread"`` (default): in the training process (a worker
            thread; for ``save="sync"`` the training thread). ``"process"``: a writer process of its own that
            maps the staging memory, so training's Python thread shares the GIL with nothing that hashes or
            writes. A write in flight when the training process dies is still committed. ``memory://`` URLs
            need ``"thread"`` (docs/async-saving.md, "Writer process").
        on_error: what a failed background write does at the next save, ``wait`` or teardown:
            ``"raise"`` an ``AsyncWriteError`` naming the file (default), or ``"warn"`` and go on. A
            ``"sync"`` save always raises.
        flush_timeout: longest wait for a pending write when the run ends by an exception,
            ``KeyboardInterrupt`` or interpreter exit (``"10min"``, seconds or a ``timedelta``).
        remote: limits of loads from and uploads to object stores (``RemoteOptions``: ``max_load_bytes``,
            ``upload_part_size``, ``upload_concurrency``; docs/remote-storage.md).
        load_in_place: read a checkpoint's weights straight into the module the run already built, instead of
            into new memory that Lightning then copies over (one copy of the weights fewer, and no new pages).
            Takes effect for the restore of a fit with ``ExactResume`` or ``RetentionCheckpoint``, which offer
            the module (:meth:`load_into`) in ``setup`` and withdraw it in ``on_fit_start``, for each weight on
            the CPU whose dtype and shape match the file's; not when the module overrides
            ``on_load_checkpoint`` (it may change the dict before Lightning copies it), nor for strategies that
            restore after their own setup (FSDP). If the load then fails (a checksum, an unknown type in the
            tree, a remote read cut mid-body), the weights read before the failure hold the file's bytes: the
            error says how many, the ``"last"`` fallback overwrites them with the checkpoint that verifies, and
            otherwise a later fit on that module in this process is refused until a load into it succeeds or
            ``format.partial.accept_partial(module)`` is called. Default ``True``; no effect on a local load
            with ``mmap``.
        dedupe: content-addressed saves (docs/safetensors-io.md, "Content-addressed saves (dedupe)"): each tensor
            of at least 64 KiB is stored once per distinct content in packs under ``<dir>/blocks/`` and referenced
            by the checkpoint file, so a save writes only what changed since the run's previous save (a frozen
            backbone, LoRA's base weights, an unchanged retention set). Needs a 128-bit or stronger ``checksum``;
            with every ``save`` mode, not with ``writer="process"`` in this release. Off by default.
    """

    records_digests = True
    """Every file records each tensor's digest (``protocols.DigestingCheckpointIO``)."""

    def __init__(
        self,
        verify: bool = True,
        checksum: Algorithm = DEFAULT_ALGORITHM,
        fallback_to_verified: bool = True,
        mmap: bool = False,
        save: SaveMode = "sync",
        writer: WriterKind = "thread",
        on_error: Literal["raise", "warn"] = "raise",
        flush_timeout: Duration = "10min",
        remote: RemoteOptions = DEFAULT_REMOTE,
        load_in_place: bool = True,
        dedupe: bool = False,
    ) -> None:
        check_versions()
        resolve_last_through_callbacks()
        problems = _problems(checksum, verify, load_in_place, save, writer, on_error, remote)
        problems += dedupe_problems(dedupe, checksum, writer)
        try:
            self.flush_timeout = parse_duration(flush_timeout, "flush_timeout")
        except ValueError as err:
            problems.append(str(err))
        if problems:
            raise ConfigurationError("SafetensorsCheckpointIO", problems)
        self.verify, self.checksum, self.fallback_to_verified, self.mmap = verify, checksum, fallback_to_verified, mmap
        self.save, self.writer, self.on_error, self.remote = save, writer, on_error, remote
        self.load_in_place, self.dedupe = load_in_place, dedupe
        self._lineage = Lineage()  # what this run's dedupe saves carry between them (``cas.save``)
        self._steps: Dict[str, Optional[int]] = {}  # a dedupe save in flight -> the step it saved
        self._upload = remote.upload
        self._into: Optional[weakref.ReferenceType[torch.nn.Module]] = None  # the module the next load fills
        self._in_place: Dict[str, Tuple[str, str]] = {}  # of the latest load: weights read in place
        self._cleaned: Set[str] = set()  # directories cleaned in full, normalised
        self._directories: Dict[str, str] = {}  # a save's parent as spelled -> its directory, normalised
        self._resolved: Dict[str, List[str]] = {}  # a "last" choice -> the candidates ranked below it
        self._loaded: Dict[str, str] = {}  # a path asked for -> the file its load read
        self._saver: Optional[AsyncSaver] = None  # every mode stages but a sync save on the training thread
        if save != "sync" or writer == "process":
            self._saver = AsyncSaver(self._commit, on_error, overlapped=save == "overlapped", writer=writer)
            atexit.register(_flush_at_exit, weakref.ref(self))

    def lend_staging(self) -> Optional[Lending]:
        """Keep an offer of each save's staged tensors from now on, for a second snapshot of the same state at the
        same point to write from instead of copying it again (``staging.lending``; ``ExactResume``'s memory tier
        at the step of a durable save); the handle that reads it. ``None`` for a ``"sync"`` save on the training
        thread, which stages nothing (``protocols.StagingLender``)."""
        return None if self._saver is None else self._saver.lend_staging()

    @override
    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"SafetensorsCheckpointIO.save_checkpoint takes no storage_options (got {storage_options!r})"
            )
        path = str(path)
        self._clean_before_save(path)
        if self._saver is None and self.dedupe:
            tree_json, tensors = write.encode_tree(checkpoint)  # fails on an unencodable value before any file exists
            step = _step(checkpoint)
            commit_deduped(path, tree_json, tensors, self.checksum, self._lineage, upload=self._upload, step=step)
            return
        if self._saver is None:
            write.save_file(checkpoint, path, algorithm=self.checksum, upload=self._upload)
            return
        if self.dedupe:
            self._steps[path] = _step(checkpoint)  # for the plan of its commit on the worker
        self._saver.save(checkpoint, path)
        if self.save == "sync":  # the writer process writes it; the save returns once it is durable
            self._saver.wait(path, on_error="raise")

    def _commit(self, path: str, tree_json: str, staged: StagedTensors) -> None:
        """The write of a staged save (on the worker thread): atomic, checksummed, at ``path``; with
        ``writer="process"`` the writer process writes and this returns once it has committed. A subclass
        extends it to act around each commit."""
        if self.dedupe:
            step = self._steps.pop(path, None)
            commit_deduped(path, tree_json, staged, self.checksum, self._lineage, staged.wait, upload=self._upload,
                           step=step)  # fmt: skip
            return
        commit_staged(path, tree_json, staged, self.checksum, upload=self._upload)

    @override
    def load_checkpoint(
        self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> Dict[str, Any]:
        """Load ``path`` (our format or a legacy ``torch.save`` file, decided by content).

        ``weights_only`` (``trainer.fit(..., weights_only=...)``, which Lightning hands over): a legacy file is
        read weights-only unless it is ``False`` (the user trusts the file: unpickled in full, as Lightning's
        own ``TorchCheckpointIO`` would); ``None`` is the safe default. Our format never runs code either way.
        """
        path = str(path)
        if self._saver is not None and self._saver.in_flight(path):
            self.wait(path)
        if not storage.exists(path, Deadline.after(self.remote.read_deadline_s)):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        self._loaded[path] = path
        self._in_place = {}
        trusted = weights_only is not False
        try:
            return self._load(path, map_location, trusted)
        except CheckpointCorruptError as err:
            if not (self.fallback_to_verified and (path in self._resolved or is_last_name(path))):
                raise
            fallback = self._load_fallback(path, err, map_location, trusted)
            if fallback is None:
                raise
            return fallback
        finally:
            self._into = None  # offered for one load: the restore it was handed over for

    def _load(self, path: str, map_location: Any, weights_only: bool = True) -> Dict[str, Any]:
        module = self._into() if self._into is not None else None
        into = self._destinations(module)
        owner = "its caller" if module is None else f"the module {type(module).__name__}"
        try:
            loaded = read.load_file(
                path, self.verify, map_location, mmap=self.mmap, max_remote_load_bytes=self.remote.max_load_bytes,
                into=into, weights_only=weights_only, into_owner=owner,
                read_deadline=self.remote.read_deadline_s,
            )  # fmt: skip
        except (CheckpointCorruptError, PartialLoadError) as err:
            if module is not None and err.overwritten_in_place:
                partial.mark(module, path, str(err), err.overwritten_in_place)  # a fit on it refuses (format.partial)
            raise
        if module is not None:
            partial.forget(module)  # a load into it succeeded: an earlier failed one no longer matters
        self._in_place = {where[1]: digest for where, digest in loaded.in_place.items()}
        if self.dedupe:
            self._lineage.adopt(path, loaded.refs)  # a resumed run continues the lineage it resumed from
        return loaded.checkpoint

    def continue_lineage(self, path: str) -> None:
        """With ``dedupe``: continue the lineage of the durable checkpoint ``path`` (its header's references only) when
        the resume reads its state elsewhere, from the memory tier's snapshot of the same run. The next save then
        references that checkpoint's packs, and the run's collections remove the packs its lineage left, as after a
        resume from ``path`` itself (``protocols.LineageKeeping``)."""
        if self.dedupe:
            self._lineage.adopt(path, read_refs(path))

    def load_into(self, module: Optional[torch.nn.Module]) -> None:
        """Offer ``module``'s own tensors to the next ``load_checkpoint`` (``load_in_place``), its fallback
        included; ``None`` withdraws it. Held weakly, and for that one load (``protocols.InPlaceLoading``).
        ``ExactResume`` and ``RetentionCheckpoint`` call this in ``setup``: Lightning loads the checkpoint after
        ``setup`` and before it moves the module to its device."""
        self._into = None if module is None else weakref.ref(module)

    def loaded_in_place(self) -> Dict[str, Tuple[str, str]]:
        """The weights the latest load read in place: state-dict name -> the file's recorded ``(algorithm,
        digest)`` of their bytes (``format.integrity``), to check the restored module against."""
        return dict(self._in_place)

    def in_place_target(self) -> Optional[Tuple[torch.nn.Module, Dict[Tuple[str, ...], torch.Tensor]]]:
        """The module offered to the next load (:meth:`load_into`) and the tensors of it that load would read in
        place (:func:`destinations`), for the memory tier, whose snapshot replaces that load; ``None`` when
        nothing is offered or this IO reads into new memory (``load_in_place=False``, ``mmap``)."""
        module = self._into() if self._into is not None else None
        into = self._destinations(module)
        return None if module is None or into is None else (module, into)

    def _destinations(self, module: Optional[torch.nn.Module]) -> Optional[Dict[Tuple[str, ...], torch.Tensor]]:
        return destinations(module) if self.load_in_place and not self.mmap and module is not None else None

    def _load_fallback(
        self, path: str, err: CheckpointCorruptError, map_location: Any, weights_only: bool = True
    ) -> Optional[Dict[str, Any]]:
        """The newest other candidate that passes its check and its load: the ones "last" resolution ranked
        below ``path``, else the checkpoints next to a ``last`` file. Nothing of ``path`` was applied yet."""
        others = self._resolved.get(path)
        ordered = newest_first(siblings(path), key=lambda p: progress(p, weights_only)) if others is None else others
        for candidate in ordered:
            why = problem(candidate, check=lambda p: self._check(p, weights_only))
            if why is None:
                try:
                    checkpoint = self._load(candidate, map_location, weights_only)
                except CheckpointCorruptError as again:
                    why = str(again)
                else:
                    warnings.warn(
                        f"{path} failed verification ({err}); resuming from the newest checkpoint that verifies:"
                        f" {candidate}",
                        SkippedCheckpointWarning,
                        stacklevel=4,
                    )
                    self._loaded[path] = candidate
                    return checkpoint
            warn_skipped(f"skipping checkpoint {candidate}: {why}")
        return None

    def resolve_newest(
        self, paths: Sequence[str], skipped: Skipped = warn_skipped, weights_only: bool = True
    ) -> Optional[str]:
        """``ckpt_path="last"`` among ``paths``: the newest (by training progress) that passes the check a load
        does not repeat. With ``verify`` and ``fallback_to_verified`` (the defaults) that is the header alone
        (``io.verify.precheck``): the load hashes every byte as it reads, and if that fails it falls back to
        the next of ``paths``, so the checkpoint is read once. Otherwise every candidate is verified in full.
        ``weights_only``: how ``torch.save`` candidates are read (``format.legacy``), as the load will read them."""
        ordered = newest_first(paths, key=lambda p: progress(p, weights_only))
        choice = newest_verified(ordered, lambda p: self._check(p, weights_only), key=None, skipped=skipped)
        if choice is not None:
            self._resolved[choice] = ordered[ordered.index(choice) + 1 :]
        return choice

    def loaded_path(self, path: str) -> str:
        """The file the latest load of ``path`` read: ``path`` itself, or the checkpoint it fell back to."""
        return self._loaded.get(str(path), str(path))

    def _check(self, path: str, weights_only: bool = True) -> None:
        """What a candidate must pass before it is loaded: the header, where the load hashes the rest."""
        if self.verify and self.fallback_to_verified:
            precheck(path, weights_only)
        else:
            verify_file(path, weights_only=weights_only)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """Delete ``path``; with a background save, queued after every write submitted before it. With ``dedupe``,
        then the packs of its lineage that no checkpoint references any more (``cas.gc``)."""
        path = str(path)

        def remove() -> None:
            if self.dedupe:
                remove_and_collect(path)
            else:
                storage.remove(path)

        if self._saver is not None and self.save != "sync":
            self._saver.remove(path, remove)
        else:
            remove()

    def verify_checkpoint(self, path: str) -> None:
        """Return if ``path`` verifies; raise ``CheckpointCorruptError`` (or ``UnsafeCheckpointError``) if not."""
        verify_file(str(path))

    # ---- staged saves (``protocols.AsyncCheckpointWriter``, ``protocols.StagingCheckpointIO``) ----------

    def reserve(self, nbytes: int, pinned: bool = False) -> None:
        """Allocate and touch the staging memory for a checkpoint of about ``nbytes`` now, in the background, so
        the first save blocks for one copy instead of the page faults of fresh memory (``ExactResume`` calls
        this after the first optimizer step; call it yourself without ``ExactResume``). A no-op for a
        ``"sync"`` save on the training thread."""
        if self._saver is not None:
            self._saver.reserve(nbytes, pinned)

    def write_in_flight(self, path: Optional[str] = None) -> bool:
        """Whether a write (of ``path``, if given) is queued or running."""
        return self._saver is not None and self._saver.in_flight(None if path is None else str(path))

    def wait(self, path: Optional[str] = None, timeout: Optional[float] = None) -> bool:
        """Block until ``path`` (or every pending write and deletion) is durable; report failures
        per ``on_error``. ``False`` if ``timeout`` seconds passed first."""
        return True if self._saver is None else self._saver.wait(None if path is None else str(path), timeout)

    @property
    def last_blocked_seconds(self) -> Optional[float]:
        """Training-thread time of the newest staged save: encoding the tree and copying the tensors."""
        return None if self._saver is None else self._saver.stats.blocked_seconds

    @property
    def last_write_seconds(self) -> Optional[float]:
        """Worker time of the newest completed write (write, hash, fsync, rename)."""
        return None if self._saver is None else self._saver.last_write_seconds

    @override
    def teardown(self) -> None:
        """Wait until every pending write is durable and report a failure (raise per ``on_error``).

        Inside an exception handler (Lightning tears down on exceptions and ``KeyboardInterrupt``) the
        wait is bounded by ``flush_timeout`` and failures are warned, never raised over the original error.
        With ``dedupe``, a teardown that ends normally then collects the run's unreferenced packs (``cas.gc``) in the
        directories it saved to: those of saves killed before their checkpoint file, left by an earlier process.
        """
        failing = sys.exc_info()[1] is not None
        if self._saver is not None and failing:
            self._flush(self.flush_timeout)
            return
        if self._saver is not None:
            self._saver.close()
        if self.dedupe and not failing:  # packs of saves killed before their checkpoint, in the directories saved to
            cleanup(self._cleaned, self._lineage.lineage)

    def _flush(self, timeout: Optional[float] = None) -> bool:
        """Wait at most ``timeout`` for pending writes and warn (never raise) about failures or a timeout."""
        if self._saver is None:
            return True
        pending = self._saver.pending()
        done = self._saver.wait(timeout=timeout, on_error="warn")
        if not done:
            warnings.warn(
                f"checkpoint write of {', '.join(pending)} did not finish within flush_timeout={timeout}s; the file will"
                " not appear (atomic commit) and the previous checkpoints are intact",
                AsyncWriteWarning,
                stacklevel=2,
            )
        return done

    def _clean_before_save(self, path: str) -> None:
        """Remove the temporaries interrupted saves left next to ``path`` (with ``dedupe``, in its ``blocks/`` too):
        at the first save into its directory all that ``clean_stale_temporaries`` judges stale (with ``dedupe``,
        and the run's unreferenced packs: ``cas.gc.cleanup``); at every later local one, this host's of dead pids
        (a save killed since, e.g. another trainer's on the same directory: one directory listing)."""
        directory = self._directories.get(storage.split(path)[0]) or self._directory_of(path)
        first = directory not in self._cleaned
        self._cleaned.add(directory)
        removed = []
        for where in [directory, storage.join(directory, BLOCKS)] if self.dedupe else [directory]:
            if first:
                removed += clean_stale_temporaries(where)
            elif is_local(where):
                removed += clean_stale_temporaries(where, owned_only=True)
            # else: a remote listing per save costs a request; the first save's cleanup covers a restart
        if first and self.dedupe:  # a resumed run: the packs a killed run of its lineage left unreferenced there
            cleanup([directory], self._lineage.lineage, temporaries=False)
        for name in removed:
            log.info("removed stale temporary %s left by an interrupted save", name)

    def _directory_of(self, path: str) -> str:
        """The directory of ``path``, normalised (a URL keeps its scheme); remembered for absolute or URL parents
        (a relative one names another directory after a chdir)."""
        parent = storage.split(path)[0]
        directory = os.path.dirname(os.path.abspath(storage.local_path(path))) if is_local(path) else parent
        if "://" in parent or os.path.isabs(parent):
            self._directories[parent] = directory
        return directory


def _step(checkpoint: Dict[str, Any]) -> Optional[int]:
    """The training step a checkpoint holds (Lightning's ``global_step``), ``None`` if it has none."""
    step = checkpoint.get("global_step")
    return step if type(step) is int else None


def _flush_at_exit(ref: weakref.ReferenceType[SafetensorsCheckpointIO]) -> None:
    """At interpreter exit (the worker is a daemon thread), give a pending write ``flush_timeout`` to finish."""
    io = ref()
    if io is not None and io.write_in_flight():
        io._flush(io.flush_timeout)


def destinations(module: torch.nn.Module) -> Optional[Dict[Tuple[str, ...], torch.Tensor]]:
    """``module``'s weights by their place in a Lightning checkpoint, for ``read.load_file(into=...)``;
    ``None`` when the module overrides ``on_load_checkpoint``: that hook may change ``checkpoint["state_dict"]``
    before Lightning copies it into the module, which tensors read in place would pass on to the module at
    once. Detached views of the module's tensors (as ``state_dict()`` gives them: no ``requires_grad``), so
    Lightning's copy of each onto the same memory returns at once (torch's ``copy_`` of a tensor onto an alias
    of the same data)."""
    hook = getattr(type(module), "on_load_checkpoint", None)
    if hook is not None and hook is not _default_on_load_checkpoint():
        return None
    return {(STATE_DICT, name): t for name, t in module.state_dict().items() if isinstance(t, torch.Tensor)}


def _default_on_load_checkpoint() -> Any:
    from lightning.pytorch.core.hooks import CheckpointHooks

    return CheckpointHooks.on_load_checkpoint


def refuse_at_fit_start(trainer: Any, module: Any) -> None:
    """At the start of ``fit``, with a ``SafetensorsCheckpointIO``: raise now what the first save would refuse,
    hours in: ``dedupe=True`` under a strategy that saves directories (``refuse_dedupe_with_directory_saves``),
    and the unencodable hyper-parameters (``refuse_unencodable_hparams``)."""
    refuse_dedupe_with_directory_saves(trainer)
    refuse_unencodable_hparams(trainer, module)


def refuse_unencodable_hparams(trainer: Any, module: Any) -> None:
    """At the start of ``fit``, with a ``SafetensorsCheckpointIO``: raise ``UnencodableValueError`` now for the
    hyper-parameters (of ``module`` and the datamodule) every save would refuse (``format.hparams``), naming them
    all with ``save_hyperparameters(ignore=[...])``, instead of at the first save. A module that overrides
    ``on_save_checkpoint`` may take them out of the checkpoint itself: its first save decides."""
    if _safetensors_io(trainer) is None or is_overridden("on_save_checkpoint", module):
        return
    tree = {}
    for key, owner in zip(HPARAMS_KEYS, (module, getattr(trainer, "datamodule", None)), strict=True):
        values = getattr(owner, "hparams", None)
        if isinstance(values, dict) and values:  # an OmegaConf container: its first save decides
            tree[key] = dict(values)
    hparams.refuse_unencodable(tree)


def refuse_dedupe_with_directory_saves(trainer: Any) -> None:
    """``ConfigurationError`` at the start of ``fit`` for ``SafetensorsCheckpointIO(dedupe=True)`` under a strategy
    that writes each checkpoint as a directory itself (FSDP's sharded state dicts, ``ModelParallelStrategy``'s
    distributed checkpoints, DeepSpeed): those saves never reach the plugin, so nothing would be deduped."""
    io = _safetensors_io(trainer)
    if io is not None and io.dedupe and saves_directories(trainer.strategy):
        raise ConfigurationError(
            "SafetensorsCheckpointIO",
            [
                f"dedupe=True is not supported under {type(trainer.strategy).__name__}, which saves each checkpoint"
                " as a directory of shards itself (the plugin never sees those saves); use dedupe=False, or a"
                " strategy that saves one file (e.g. FSDPStrategy(state_dict_type='full'))"
            ],
        )


def _safetensors_io(trainer: Any) -> Optional[SafetensorsCheckpointIO]:
    """The trainer's ``SafetensorsCheckpointIO``, also inside a wrapping IO (Lightning's ``AsyncCheckpointIO``)."""
    io: Optional[SafetensorsCheckpointIO] = checkpoint_io_as(trainer, SafetensorsCheckpointIO)
    return io


def _problems(
    checksum: str, verify: Any, load_in_place: Any, save: str, writer: str, on_error: str, remote: Any
) -> List[str]:
    """Every invalid option, named with its value and the fix. Each option is checked alone: every
    combination of valid values works."""
    found = []
    if checksum not in ALGORITHMS:
        found.append(f"checksum={checksum!r} is not supported; use one of {list(ALGORITHMS)}")
    for name, value in (("verify", verify), ("load_in_place", load_in_place)):
        if not isinstance(value, bool):
            found.append(f"{name}={value!r} must be True or False")
    for name, value, allowed in (("save", save, SAVE_MODES), ("writer", writer, WRITERS),
                                 ("on_error", on_error, ("raise", "warn"))):  # fmt: skip
        if value not in allowed:
            found.append(f"{name}={value!r} is not supported; use one of {list(allowed)}")
    if not isinstance(remote, RemoteOptions):
        found.append(f"remote={remote!r} must be a RemoteOptions(max_load_bytes=..., upload_part_size=..., ...)")
    return found


def dedupe_problems(dedupe: Any, checksum: str, writer: str) -> List[str]:
    """What ``dedupe=True`` cannot go with in this release, each named with the fix (never a silent full save)."""
    if not isinstance(dedupe, bool):
        return [f"dedupe={dedupe!r} must be True or False"]
    if not dedupe:
        return []
    found = []
    if checksum == "crc32":
        found.append(
            "dedupe=True needs a 128-bit or stronger checksum; use checksum='xxh3-128' (default), 'sha256' or 'blake2b'"
        )
    if writer == "process":
        found.append(
            "dedupe=True is not supported with writer='process' in this release (the writer process commits whole"
            " files; a dedupe save's packs and references are written on the writer thread); use writer='thread'"
            " (the default; save='async' or 'overlapped' still writes off the training thread), or dedupe=False"
        )
    return found
