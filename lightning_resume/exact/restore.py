"""Restoring what ``ExactResume`` saved, in the order the uninterrupted run consumed randomness.

``restore`` runs at ``on_train_start``, after Lightning created the training iterator (which draws from
the global RNG) and before the first batch is fetched: it checks the checkpoint fits this run (every
rank agreeing), applies the loader positions, puts back prefetched batches, restores every RNG stream,
re-arranges a validation that was due right after the saved step, and checks the fingerprint. Where
exactness is impossible it refuses (``strict``) or warns, naming each difference. Reads and changes the
trainer only through ``_compat.lightning``.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple, Optional, Protocol, Union

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from lightning_resume import collective
from lightning_resume._compat import lightning as lc
from lightning_resume.errors import ExactResumeWarning, ResumeMismatchError
from lightning_resume.exact import capture, epoch_hooks, lightning_gaps
from lightning_resume.exact import elastic as elastic_restore
from lightning_resume.exact.capture import AT_STEP_BOUNDARY, FORMAT_VERSION, fingerprint_of, signature
from lightning_resume.exact.elastic import Afterwards, ElasticMode, Move
from lightning_resume.exact.state import rank_local
from lightning_resume.exact.state.data import is_resumable, load_loader_state, loader_signature
from lightning_resume.exact.state.elastic import old_rank_for
from lightning_resume.exact.state.fingerprint import (
    digest,
    fingerprint_mismatches,
    tensor_digests,
    unsaved_buffer_mismatches,
    weights_digest,
)
from lightning_resume.exact.state.rng import capture_rng, restore_rng, rng_mismatches
from lightning_resume.exact.state.samplers import EpochPlan
from lightning_resume.exact.state.user import UserState, restore_user_state
from lightning_resume.format import integrity
from lightning_resume.format.framing import host_bytes

CHECKED_PARTS = ("weights", "optimizer", "rng", "step")
"""Fingerprint parts compared after a restore (the data part is compared through the loader states)."""


def restore(
    trainer: pl.Trainer,
    saved: Mapping[str, Any],
    strict: bool,
    check_fingerprint: bool,
    elastic: ElasticMode = False,
    loaded: Optional[LoadedDigests] = None,
    user: Optional[UserState] = None,
) -> tuple[ResumeReport, Afterwards]:
    """Restore ``saved`` into the running ``trainer`` (every rank calls it); return the resume report and what
    the restore changed for a while (put back at the resumed epoch's end and at teardown).

    Another world size is dealt out (``exact.elastic``) with ``elastic``, and with ``strict=False``. ``loaded``:
    the digests of the checkpoint as loaded (``loaded_digests``), for fingerprints saved without the weights.
    ``user``: the state users keep outside Lightning, put back before the data position and the RNG streams
    (the iterator made again may fetch a batch from it: a dataset over a buffer, a generator it holds)."""
    afterwards = Afterwards()
    elastic_restore.refuse_bad_numbers(trainer, saved, bool(elastic) or not strict)  # before any number is used
    moved = int(saved.get("world_size", 1)) != trainer.world_size and (bool(elastic) or not strict)
    differences = collective.agreed(differences_from(trainer, saved, world_may_change=moved))
    if differences:
        refuse_or_warn(strict, trainer.ckpt_path, differences)
    if moved and not elastic:  # strict=False: dealt out like elastic=True where it can be, else approximate
        cannot = collective.agreed(elastic_restore.unremappable(trainer, saved, True))
        if cannot:
            moved = False
            lines = [f"world size {saved.get('world_size')} -> {trainer.world_size}: {line}" for line in cannot]
            warn_approximate([*lines, "the data position is not restored: the epoch restarts from its beginning"])
            differences = [*differences, *lines]
            saved = dict(
                saved, ranks=[dict(r, loaders=[None] * len(r["loaders"]), prefetched=[]) for r in saved["ranks"]]
            )
    mid_step = capture_point_problem(saved)
    if mid_step is not None:
        warn_approximate([mid_step])
        differences = [*differences, mid_step]
    mine = state_for_this_rank(trainer, saved)
    unapplied = collective.agreed(rank_local.put_back(trainer.lightning_module, mine.get("buffers") or {}))
    if unapplied:
        refuse_or_warn(strict, trainer.ckpt_path, unapplied)
        differences = [*differences, *unapplied]
    lc.restore_callback_metrics(trainer, dict(mine.get("metrics") or {}))  # the next save decisions read them
    lc.restore_last_saved_steps(trainer, dict(saved.get("last_saved") or {}))  # no second save of this step
    lightning_gaps.restore_callbacks(trainer, saved.get(lightning_gaps.KEY))
    restored_user, unmatched = restore_user_state(user, mine.get("user") or {})
    if unmatched:
        warn_approximate(unmatched)
        differences = [*differences, *unmatched]
    differences = [*differences, *lightning_gaps.restore_logged(trainer, mine)]  # self.log's epoch so far
    checked: tuple[str, ...] = CHECKED_PARTS
    moved_fields: dict[str, Any] = {}
    if moved:
        dealt = elastic_restore.DealtPosition.prepare(trainer, saved, elastic or True)
        restored_rng = restore_position_and_rng(trainer, mine, afterwards, dealt)
        move = dealt.move(trainer, mine)
        who = f"ExactResume(elastic={elastic!r})" if elastic else "ExactResume(strict=False)"
        rank_zero_warn(f"{who}: {move.sentence()}", category=ExactResumeWarning)
        differences = [*differences, move.sentence()]
        moved_fields = moved_report(move)
        checked = ("weights", "optimizer", "step") if not capture.sharded(trainer) else ()
    else:
        elastic_restore.keep_accumulation(trainer, saved, elastic)
        position = SavedPosition(saved.get("signature", {}).get("loaders", []))
        restored_rng = restore_position_and_rng(trainer, mine, afterwards, position)
    fingerprint_ok: Optional[bool] = None
    unsaved: list[str] = []
    if check_fingerprint and "fingerprint" in mine and checked:
        fingerprint_ok, unsaved = check_restored(trainer, strict, mine, restored_rng, checked, loaded)
    report = ResumeReport(
        step=trainer.global_step, exact=not differences, differences=tuple(differences),
        user_state=tuple(restored_user), fingerprint_ok=fingerprint_ok, unsaved_buffers_differ=tuple(unsaved),
        **moved_fields,
    )  # fmt: skip
    lightning_gaps.owed_after_save(trainer, saved.get(lightning_gaps.KEY), mine)  # after the check: LR changes
    if lightning_gaps.next_epoch_is_ours(trainer, mine):
        start_next_epoch(trainer)  # after the check: the next epoch's start hooks may change the state
    return report, afterwards


def check_restored(
    trainer: pl.Trainer,
    strict: bool,
    mine: Mapping[str, Any],
    restored_rng: Any,
    checked: tuple[str, ...],
    loaded: Optional[LoadedDigests],
) -> tuple[bool, list[str]]:
    """Compare the state after the restore with this rank's saved fingerprint (the ``checked`` parts, every rank
    agreeing); refuse or warn on a mismatch. Return whether it matched and the non-persistent buffers that
    differ (warned, not refused)."""
    saved_print = dict(mine["fingerprint"])
    restored = fingerprint_of(trainer, restored_rng, None)
    if loaded is not None and "weights" not in saved_print:  # the file proved what was saved: compare with it
        saved_print, restored = compared_with_loaded(trainer, loaded, mine, saved_print, restored)
    bad = collective.agreed(fingerprint_mismatches(saved_print, restored, checked))
    if bad:
        refuse_or_warn(strict, trainer.ckpt_path, [f"fingerprint after restore: {line}" for line in bad])
    unsaved = collective.agreed(unsaved_buffer_mismatches(mine["fingerprint"], restored))
    if unsaved:
        warn_unsaved_buffers(unsaved)
    return not bad, unsaved


LoadedDigests = dict[str, Any]
"""``{"tensors": {state dict key: digest}, "optimizer": digest or None}`` of a loaded checkpoint."""


InPlace = Mapping[str, tuple[str, str]]
"""Weights a load read straight into the module (``SafetensorsCheckpointIO.loaded_in_place``): state-dict
name -> the file's recorded ``(algorithm, digest)`` of their bytes."""


def loaded_digests(checkpoint: Mapping[str, Any], in_place: InPlace = MappingProxyType({})) -> Optional[LoadedDigests]:
    """What the restored state is compared with when the saved fingerprint left the weights to the file's own
    digests (``capture.files_prove_tensors``): the loaded checkpoint's, taken once, while Lightning holds it.
    A weight read in place is the module's own memory, so hashing it here would prove nothing: the file's
    recorded digest of it stands in, and the module is hashed the file's way after the restore."""
    state = checkpoint.get("state_dict")
    if not isinstance(state, Mapping):
        return None  # a sharded checkpoint loads in place: there is no dict to compare with
    in_place = {name: in_place[name] for name in state if name in in_place}
    held = tensor_digests({name: value for name, value in state.items() if name not in in_place})
    tensors = {**held, **{name: _as_file_digest(*pair) for name, pair in in_place.items()}}
    optimizers = checkpoint.get("optimizer_states")
    return {
        "tensors": tensors, "in_place": in_place, "optimizer": None if optimizers is None else digest(list(optimizers))
    }  # fmt: skip


def _as_file_digest(algorithm: str, value: str) -> str:
    return f"file:{algorithm}:{value}"


def _module_digests(state: Mapping[str, Any], in_place: InPlace) -> dict[str, str]:
    """``tensor_digests`` of a module's state, the weights read in place hashed as the file hashed them."""
    held = tensor_digests({name: value for name, value in state.items() if name not in in_place})
    for name, (algorithm, _) in in_place.items():
        if name in state:
            held[name] = _as_file_digest(algorithm, integrity.digest(algorithm, host_bytes(state[name])))
    return held


def compared_with_loaded(
    trainer: pl.Trainer,
    loaded: LoadedDigests,
    mine: Mapping[str, Any],
    saved_print: dict[str, str],
    restored: dict[str, str],
) -> tuple[dict[str, str], dict[str, str]]:
    """The saved fingerprint completed with the loaded checkpoint's weights and optimizer digests, and the
    restored one made comparable: the buffers this rank holds differently from rank 0 (``rank_local``, put
    back on purpose) are left out on both sides."""
    leave_out = set(mine.get("buffers") or {})
    live = _module_digests(trainer.lightning_module.state_dict(), loaded.get("in_place") or {})
    expected = dict(saved_print, weights=weights_digest(loaded["tensors"], leave_out))
    actual = dict(restored, weights=weights_digest(live, leave_out))
    if loaded.get("optimizer") is not None:
        expected["optimizer"] = loaded["optimizer"]
    return expected, actual


def warn_unsaved_buffers(names: list[str]) -> None:
    """Buffers registered with ``persistent=False`` are in no checkpoint; a warning, not a refusal, when they
    come back different, since a cache filled on first use differs harmlessly."""
    rank_zero_warn(
        f"ExactResume: non-persistent buffers {names} are not in checkpoints and differ from the saving run's"
        " after restore. A cache recomputed from its inputs is harmless; state that training updates is not: "
        "register it with persistent=True, or recompute it in on_load_checkpoint.",
        category=ExactResumeWarning,
    )


def state_for_this_rank(trainer: pl.Trainer, saved: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's saved state; on another world size, saved rank ``r % W``'s (``elastic.old_rank_for``)."""
    ranks = saved["ranks"]
    return dict(ranks[old_rank_for(trainer.global_rank, len(ranks))])


class Position(Protocol):
    """Where the resumed epoch's data comes from and whose RNG streams a rank continues: the part of the one
    restore sequence (``restore_position_and_rng``) that differs between the saved world size (``SavedPosition``)
    and another (``exact.elastic.DealtPosition``). Neither decides when it runs: the sequence does."""

    def place(self, trainer: pl.Trainer, mine: Mapping[str, Any], afterwards: Afterwards) -> Optional[EpochPlan]:
        """Put the data position in place and make the epoch's iterator (both may draw); return the planned
        epoch whose length Lightning must be told, if any."""
        ...

    def reseed(self, trainer: pl.Trainer, mine: Mapping[str, Any]) -> None:
        """After this rank's saved streams are restored: the streams of a rank that has none of its own."""
        ...

    def finish(self, trainer: pl.Trainer) -> None:
        """After the due validation: what the position changes for the rest of the run."""
        ...


@dataclass(frozen=True)
class SavedPosition:
    """The saved world size: each loader takes this rank's saved position, the iterator its prefetched batches
    (and the plan of an epoch an elastic resume dealt), and every rank continues its own streams."""

    signatures: list[Mapping[str, Any]]
    """The saved loaders' signatures (a loader whose workers changed restarts its epoch)."""

    def place(self, trainer: pl.Trainer, mine: Mapping[str, Any], afterwards: Afterwards) -> Optional[EpochPlan]:
        loaders = lc.train_loaders(trainer)
        plan = elastic_restore.put_back_plan(trainer, mine, afterwards)  # an epoch an elastic resume dealt
        _load_loader_states(loaders, mine["loaders"], self.signatures)
        if mine["epoch_exhausted"]:
            lc.apply_loader_states(loaders)
        else:
            # The sampler's epoch picks its order; the iterator Lightning made before the restore had the default.
            lc.set_sampler_epoch(loaders, trainer.current_epoch)
            lightning_gaps.restart_train_iterator(trainer, mine)  # with the saved prefetched batches
        return plan

    def reseed(self, trainer: pl.Trainer, mine: Mapping[str, Any]) -> None:
        """Every rank has its own saved streams: nothing to add."""

    def finish(self, trainer: pl.Trainer) -> None:
        """Nothing changes for the rest of the run (``keep_accumulation`` ran before the sequence)."""


def restore_position_and_rng(
    trainer: pl.Trainer,
    mine: Mapping[str, Any],
    afterwards: Afterwards,
    position: Position,
) -> Any:
    """The one order of a restore, the order in which the uninterrupted run consumed randomness; return the RNG
    as restored. Every step that draws comes before the streams are put back, so what it drew is undone: the
    replayed epoch-start hooks of an epoch under way, then the data position and the epoch's new iterator
    (``position.place``). Then this rank's saved streams, and a new rank's own (``position.reseed``), captured as
    restored. Then the planned epoch's length, and the validation that was due right after the saved step,
    which draws from the restored streams. Last, what the position changes for the rest of the run."""
    if not mine["epoch_exhausted"]:
        epoch_hooks.warn_not_replayed(epoch_hooks.replay_epoch_start(trainer))
    plan = position.place(trainer, mine, afterwards)
    restore_rng(mine["rng"])
    position.reseed(trainer, mine)
    restored_rng = capture_rng()
    if plan is not None:
        elastic_restore.planned_length(trainer, plan, afterwards)
    if mine["validation_pending"]:  # on every rank, as the saving run's ranks did
        lc.run_due_validation(trainer, mine["epoch_exhausted"], int(mine.get("epoch", trainer.current_epoch)))
    position.finish(trainer)
    return restored_rng


def start_next_epoch(trainer: pl.Trainer) -> None:
    """After a save at an epoch's end, start the next epoch as the uninterrupted run did: its start hooks
    where Lightning skips them, then its iterator, made after the RNG it draws its seed from is restored."""
    lc.leave_finished_epoch(trainer)  # with max_steps, Lightning would restart inside the finished epoch
    lc.set_sampler_epoch(lc.train_loaders(trainer), trainer.current_epoch)
    epoch_hooks.warn_not_replayed(epoch_hooks.start_skipped_epoch(trainer))
    lc.restart_train_iterator(trainer)
    lc.skip_validation_fast_forward(trainer)


def _load_loader_states(loaders: list[Any], states: list[Any], signatures: list[Mapping[str, Any]]) -> None:
    for i, (loader, state) in enumerate(zip(loaders, states, strict=False)):
        if state is None or not is_resumable(loader):
            continue
        if i < len(signatures) and signatures[i].get("num_workers") != loader_signature(loader)["num_workers"]:
            rank_zero_warn(
                f"ExactResume: train loader {i} changed num_workers; its epoch restarts from the beginning",
                category=ExactResumeWarning,
            )
            continue
        load_loader_state(loader, state)


def capture_point_problem(saved: Mapping[str, Any]) -> Optional[str]:
    """Why a checkpoint captured mid-step (inside a training step or validation) cannot resume exactly; ``None``
    at a step boundary. Not a mismatch with the run: such a checkpoint (Lightning's own, from an exception hook or
    a signal handler) resumes approximately, with a warning, whatever ``strict`` says."""
    captured_at = saved.get("captured_at", AT_STEP_BOUNDARY)
    if captured_at == AT_STEP_BOUNDARY:
        return None
    return (
        f"the checkpoint was captured {captured_at.replace('_', ' ')} (e.g. by a signal handler or an exception"
        " hook), not at a step boundary: the work half done then is not in it, so the run resumes from there"
        " approximately; let ExactResume take preemption snapshots (preemption.signals) instead"
    )


def differences_from(
    trainer: pl.Trainer,
    saved: Mapping[str, Any],
    world_may_change: bool = False,
) -> list[str]:
    """Every way the checkpoint does not fit this run, one line each (empty: an exact resume is possible).
    ``world_may_change``: another world size is dealt out (``exact.elastic``), so it is not listed."""
    out = []
    if saved.get("format") != FORMAT_VERSION:
        out.append(f"ExactResume state format {saved.get('format')!r}, this version reads {FORMAT_VERSION}")
    if saved.get("world_size") != trainer.world_size and not world_may_change:
        out.append(
            f"world size: checkpoint written by {saved.get('world_size')} processes, this run has"
            f" {trainer.world_size}; pass ExactResume(elastic=True) to continue on {trainer.world_size} with every"
            " sample of the epoch trained once (the run is then not bitwise the one on the old world size)"
        )
    ranks = saved.get("ranks", [])
    mine = ranks[old_rank_for(trainer.global_rank, len(ranks))] if ranks else {}
    positions = [state is not None for state in mine.get("loaders", [])]
    # Dealt out anew, an epoch's rest does not depend on the loader's workers (its saved position is not loaded).
    ignored = ("num_workers",) if world_may_change else ()
    out += _signature_differences(saved.get("signature", {}), signature(trainer), positions, ignored)
    if mine:
        out += rng_mismatches(mine["rng"])
    return out


def _signature_differences(
    then: Mapping[str, Any],
    now: Mapping[str, Any],
    positions: Optional[list[bool]] = None,
    ignored: tuple[str, ...] = (),
) -> list[str]:
    """What differs in the run's structure; a loader whose checkpoint holds no position (one that cannot save
    it) is not compared: nothing saved would be applied to it."""
    out = []
    for i, (a, b) in enumerate(zip(then.get("loaders", []), now["loaders"], strict=False)):
        if positions is not None and i < len(positions) and not positions[i]:
            continue
        out += [
            f"train loader {i} {k}: checkpoint {a.get(k)!r}, now {b.get(k)!r}"
            for k in b
            if a.get(k) != b[k] and k not in ignored
        ]
    if len(then.get("loaders", [])) != len(now["loaders"]):
        out.append(f"number of train loaders: checkpoint {len(then.get('loaders', []))}, now {len(now['loaders'])}")
    if then.get("model") != now["model"]:
        out.append("model structure (parameter names, shapes or dtypes) differs from the checkpoint")
    if then.get("optimizers") != now["optimizers"]:
        out.append(f"optimizer structure: checkpoint {then.get('optimizers')}, now {now['optimizers']}")
    return out


def refuse_or_warn(strict: bool, source: Optional[Union[str, os.PathLike[str]]], differences: list[str]) -> None:
    """``strict``: raise ``ResumeMismatchError`` naming the checkpoint and each difference; else warn."""
    if strict:
        raise ResumeMismatchError(
            str(source or "the checkpoint"),
            differences,
            "Fix the run to match the checkpoint, or pass ExactResume(strict=False) to continue approximately.",
        )
    warn_approximate(differences, "ExactResume(strict=False)")


def warn_approximate(differences: list[str], who: str = "ExactResume") -> None:
    """One warning listing what will not be exact in a resume that goes on."""
    rank_zero_warn(
        f"{who}: resuming approximately; these will not be exact:\n" + "\n".join(f"  - {d}" for d in differences),
        category=ExactResumeWarning,
    )


AGREEMENT_TIMEOUT_S = 300.0
"""How long ranks wait for each other at the start-of-run agreement (they may still be loading the
checkpoint) before every rank that arrived raises ``RanksOutOfStepError`` naming the others."""


def check_same_checkpoint(trainer: pl.Trainer, pending: Optional[Mapping[str, Any]]) -> None:
    """Every rank resumes from the same checkpoint, or every rank raises the same ``ResumeMismatchError``.

    Ranks resolve ``ckpt_path`` each on their own files; with per-node checkpoint directories one node
    may find a checkpoint and another none (or an older one), and the ranks would then train apart and
    block in different collectives. One gather of (step, save time) settles it (every rank calls it).
    """
    if trainer.world_size <= 1:
        return
    collective.all_arrive("the check that every rank resumes from the same checkpoint", AGREEMENT_TIMEOUT_S)
    mine = (str(trainer.ckpt_path) if trainer.ckpt_path else None, trainer.global_step, (pending or {}).get("saved_at"))
    everyone = collective.gather(mine, trainer.world_size)
    if len({(step, saved) for _, step, saved in everyone}) <= 1:
        return
    lines = [
        f"rank {rank}: " + (f"{path} (step {step})" if path else "no checkpoint found: a fresh start")
        for rank, (path, step, _) in enumerate(everyone)
    ]
    raise ResumeMismatchError(
        "the resolved checkpoints",
        lines,
        "Every rank must resume from the same checkpoint: keep checkpoints on a filesystem all nodes share, or"
        " copy rank 0's checkpoint directory to every node before relaunching.",
    )


class BeforeAfter(NamedTuple):
    """A quantity in the saving run and from the resume on (``ResumeReport`` on another world size)."""

    before: int
    after: int


@dataclass(frozen=True)
class ResumeReport:
    """What ``ExactResume`` restored when training started: ``ExactResume.resume_report``.

    Set at ``on_train_start`` on every rank; before it (and on a fresh start) every field but ``source`` is
    empty. ``report.exact`` says whether the run continues bit for bit; where it does not, ``differences`` says
    why, one line each (each was also warned). ``report["key"]``, the dict of earlier versions, still works in
    this release with a ``DeprecationWarning`` naming the attribute; ``to_dict()`` gives that dict."""

    source: Optional[str] = None
    """The checkpoint file resumed from (the one that loaded, where ``"last"`` fell back); ``None``: a fresh start."""
    step: Optional[int] = None
    """The global step training resumed at; ``None``: nothing was restored (a fresh start, or a checkpoint
    without ExactResume's state)."""
    exact: Optional[bool] = None
    """``True``: the run continues bit for bit; ``False``: not exactly (``differences``); ``None``: nothing restored."""
    differences: tuple[str, ...] = ()
    """Every way this resume is not exact (a checkpoint that does not fit the run under ``strict=False``, a
    capture mid-step, a loader whose position cannot be saved, another world size), one line each."""
    user_state: tuple[str, ...] = ()
    """The paths of the state kept outside Lightning that was restored (``"model.lr_scheduler"``)."""
    fingerprint_ok: Optional[bool] = None
    """The state's fingerprint after the restore matched the saved one; ``None``: not checked
    (``ExactResume(fingerprint=False)``, no fingerprint saved, or a sharded run resumed on another world size)."""
    unsaved_buffers_differ: tuple[str, ...] = ()
    """Non-persistent buffers (in no checkpoint) that differed from the saving run's right after the restore."""
    tier: Optional[str] = None
    """Where the run resumed from: ``"memory"`` (every rank's own memory-tier snapshot), ``"replica"`` (memory-tier
    snapshots, some rank's from a peer's replica: its node was lost; ``memory_sources`` says whose) or
    ``"durable"`` (a checkpoint file); ``None``: nothing restored."""
    memory_sources: Optional[tuple[int, ...]] = None
    """Resumed from the memory tier: one entry per rank, ``memory_sources[r]`` the rank whose memory held rank ``r``'s
    state (``r`` itself, or the peer that held its replica: a rank of another node); ``None`` otherwise."""
    memory_tier: Optional[str] = None
    """Why the memory tier's snapshots were not used (they were taken on another world size); ``None``: no reason."""
    sample_exact: Optional[bool] = None
    """On another world size (``elastic``): ``True``, every sample of the interrupted epoch is trained once;
    ``None`` on the saved world size (where ``exact`` says more)."""
    world_size: Optional[BeforeAfter] = None
    """On another world size: the checkpoint's number of processes and this run's; else ``None``."""
    global_batch: Optional[BeforeAfter] = None
    """On another world size: samples per optimizer step, before and after; else ``None``."""
    accumulate_grad_batches: Optional[BeforeAfter] = None
    """On another world size: gradient accumulation before and after (``elastic="keep_global_batch"`` changes
    it); else ``None``."""
    untrained: Optional[int] = None
    """Dealt inside an interrupted epoch: the samples of it not yet trained, dealt to the new ranks."""
    repeated: Optional[int] = None
    """Dealt inside an interrupted epoch: samples trained twice so that every rank has as many."""
    dropped: Optional[int] = None
    """Dealt inside an interrupted epoch: samples left out (the sampler's ``drop_last``)."""

    @property
    def resumed(self) -> bool:
        """Whether anything was restored (``step`` is set)."""
        return self.step is not None

    def to_dict(self) -> dict[str, Any]:
        """The report as the plain, JSON-ready dict of earlier versions: ``source`` always, the lists only when
        something was restored, ``unsaved_buffers_differ`` only when some differ, other fields unless ``None``;
        ``world_size`` as ``{"checkpoint", "now"}``, the other pairs as ``{"before", "after"}``."""
        out: dict[str, Any] = {"source": self.source}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "source" or value is None or (f.name == "unsaved_buffers_differ" and not value):
                continue
            if f.name in ("differences", "user_state") and not self.resumed:
                continue
            if isinstance(value, BeforeAfter):
                names = ("checkpoint", "now") if f.name == "world_size" else ("before", "after")
                value = dict(zip(names, value, strict=True))
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def __getitem__(self, key: str) -> Any:
        _deprecated_key(key)
        return self.to_dict()[key]

    def get(self, key: str, default: Any = None) -> Any:
        """``report.get("key")`` of earlier versions (deprecated: read the attribute)."""
        _deprecated_key(key)
        return self.to_dict().get(key, default)

    def __contains__(self, key: object) -> bool:
        _deprecated_key(str(key))
        return key in self.to_dict()


def _deprecated_key(key: str) -> None:
    known = key in {f.name for f in fields(ResumeReport)}
    use = f"ExactResume.resume_report.{key}" if known else "the attributes of ResumeReport"
    warnings.warn(
        f"ExactResume.resume_report[{key!r}] is deprecated (the report is a ResumeReport): use {use}; "
        "to_dict() gives the earlier dict. Item access goes in the next release.",
        DeprecationWarning,
        stacklevel=3,
    )


def moved_report(move: Move) -> dict[str, Any]:
    """The ``ResumeReport`` fields of a resume on another world size."""
    before, after = move.global_batch()
    out: dict[str, Any] = {
        "sample_exact": True,
        "world_size": BeforeAfter(move.old_world, move.new_world),
        "global_batch": BeforeAfter(before, after),
        "accumulate_grad_batches": BeforeAfter(*move.accumulate),
    }
    if move.deal is not None:
        out.update(untrained=move.deal.untrained, repeated=len(move.deal.padded), dropped=len(move.deal.dropped))
    return out


def as_launched(
    report: ResumeReport,
    source: Optional[str],
    tier: Optional[str],
    memory_tier: bool,
    unsaved: list[str],
    memory_sources: Optional[tuple[int, ...]] = None,
) -> ResumeReport:
    """The report of a launch: the ``source`` resumed from and, where something was restored, what the callback
    adds: the ``tier`` resumed from and from whose memory each rank's state came (``memory_sources``), why a
    memory tier's snapshots were not used (another world size), and the loaders whose position could not be
    saved (then not exact)."""
    if not report.resumed:
        return replace(report, source=source)
    memory = None
    if memory_tier and report.world_size is not None:
        memory = f"snapshots of {report.world_size.before} ranks not used: resumed from disk"
    exact = False if unsaved else report.exact
    differences = (*report.differences, *unsaved)
    return replace(
        report,
        source=source,
        tier=tier,
        memory_tier=memory,
        exact=exact,
        differences=differences,
        memory_sources=memory_sources,
    )
