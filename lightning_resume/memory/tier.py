"""ExactResume's memory tier in a Lightning run: where its snapshots live, taking them, resuming from them.

The store (``memory.store``) keeps one verified file per rank in this user's private shared-memory root.
Here: the run's slot is named by the durable checkpoint directory, and the run by an id that every
checkpoint carries (``RUN_KEY`` in ``ExactResume``'s state): made at a fresh start, kept across resumes. A
snapshot is the trainer's full checkpoint dict, built on every rank; on ``fit(ckpt_path="last")`` the memory
tier replaces the durable checkpoint Lightning resolved when every rank can obtain a verified snapshot of that
checkpoint's run, of the same step and save sequence, newer (by global step) than that checkpoint: its own,
or (its node lost) the replica a peer node holds, streamed to it and verified (``memory.recover`` decides,
``memory.peers`` moves it). Otherwise every rank falls back to disk together, "last" then verified in full
(it read only headers while the memory tier was asked first: ``retention.last``), and the snapshots that are
not the resume source are dropped, so a later resume never goes back to another line of training. A checkpoint directory emptied by
hand holds no run id, so the next start is a new run, whatever shared memory still holds. When another
user holds the name of this user's root first (a directory, a file, a link), the run's snapshots go to a
fallback root of a random name (``store.fallback_root``), said once; its token travels in every checkpoint
(``ROOT_KEY``) beside the run id, so a relaunch looks there.
"""

from __future__ import annotations

import secrets
import warnings
from functools import partial
from typing import Any, Callable, Mapping, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_resume import collective
from lightning_resume._compat import lightning as lc
from lightning_resume.errors import (
    AsyncWriteError,
    CheckpointCorruptError,
    ConfigurationError,
    ExactResumeWarning,
    LightningResumeError,
    PartialLoadError,
)
from lightning_resume.format import partial as partly
from lightning_resume.memory import peers, transport
from lightning_resume.memory import replicate as replication
from lightning_resume.memory.recover import NoRecovery, Outcome, RecoveryPlan, plan_recovery
from lightning_resume.memory.replicate import Replicator, Ring
from lightning_resume.memory.store import (
    ROOT_KEY,
    MemorySnapshot,
    MemoryStore,
    NotEnoughSharedMemory,
    durable_run,
    durable_step,
    durable_value,
    fallback_root,
    memory_root,
    slot_key,
    squatted,
)
from lightning_resume.protocols import (
    InPlaceTarget,
    Loan,
    LocalShardSnapshots,
    StagingLender,
    checkpoint_io_as,
    continue_lineage,
    in_place_target,
)
from lightning_resume.protocols import loaded_in_place as io_loaded_in_place
from lightning_resume.retention.last import confirm_last
from lightning_resume.schedule.state import Tier
from lightning_resume.staging.lending import Offer

MEMORY, DURABLE, REPLICA = Tier.MEMORY.value, Tier.DURABLE.value, Tier.REPLICA.value
"""The tiers a run can resume from (``ExactResume.resume_report.tier``): ``REPLICA`` when the memory tier resumed
and some rank's state came from a peer node's replica (its own node was lost): a node loss in the failure history."""


Chosen = Union[tuple[str, dict[str, Any]], str, None]
"""What :meth:`MemoryTier.choose` answers: ``(path, checkpoint)`` from memory, or the durable checkpoint to restore."""

Confirm = Callable[[], Optional[str]]
"""The full "last" resolution, asked when the memory tier does not supply the resume."""


FLUSH_TIMEOUT_S = 60.0
"""How long an exception waits for the memory-tier snapshot being written (one tmpfs write of the state)."""


class MemoryTier:
    """One run's memory tier: set up per ``fit``, saves at step boundaries, chooses the resume source.

    ``memory_dir``: the tmpfs under which this user's root ``lightning-resume-<uid>`` lives. ``replicas``: the
    option (``MemoryTierOptions.replicas``), resolved at :meth:`setup` into :attr:`replicas`."""

    def __init__(self, memory_dir: str, replicas: Optional[int] = None) -> None:
        self.memory_dir = str(memory_dir)
        self.replicas_option = replicas
        self.ring = Ring()  # resolved at setup: replica count, holders, owners, the transfer group
        self.replicator: Optional[Replicator] = None  # this fit's, from train start
        self.root = memory_root(memory_dir)
        self.root_token: Optional[str] = None  # the fallback root's (``ROOT_KEY``), when the name is squatted
        self.store: Optional[MemoryStore] = None
        self.run: Optional[str] = None
        self.seq = 0
        self.resumed_tier: Optional[str] = None
        self.sources: Optional[tuple[int, ...]] = None  # per rank, the rank whose memory held its resumed state
        self._group: Any = None  # the transfer group of a recovery from peers
        self.warned_full = False
        self.dumping = False
        self._warned_failed = False
        self.directory, self.rank, self.world_size = "", 0, 1
        self._remove_hook: Optional[Callable[[], None]] = None
        self._lending: Optional[Loan] = None  # the durable IO's staging, when it lends it
        self._overlap = False
        self.weights_only = True
        self._shards: Optional[LocalShardSnapshots] = None  # a sharded strategy's: snapshots of local shards
        self._target: Callable[[], Optional[InPlaceTarget]] = lambda: None  # what the durable load would read into
        self._continue_lineage: Callable[[str], None] = lambda path: None  # the durable IO's dedupe lineage (cas)
        self._in_place: dict[str, tuple[str, str]] = {}  # the weights the memory resume read into the module

    def setup(self, trainer: pl.Trainer, directory: Optional[str]) -> None:
        """Find this rank's slot in ``directory`` (the durable checkpoints', which names the run) and, for
        ``fit(ckpt_path="last")``, have the resume consider the memory tier first. Nothing is made here: a
        fresh run's directories appear at its first snapshot."""
        if directory is None:
            raise ConfigurationError("ExactResume", [
                "memory_tier needs a checkpoint directory to name the run: add a RetentionCheckpoint or"
                " ModelCheckpoint, or leave memory_tier unset"
            ])  # fmt: skip
        self.directory, self.rank, self.world_size = directory, trainer.global_rank, trainer.world_size
        lender: Optional[StagingLender] = checkpoint_io_as(trainer, StagingLender)
        # a snapshot at a durable save's step writes from that save's staging, and copies as it does
        self._lending = None if lender is None else lender.lend_staging()
        overlap = self._lending is not None and self._lending.overlapped  # the user's choice, for both tiers
        self._overlap = overlap
        self.store = MemoryStore(self.root, slot_key(directory), self.rank, self.world_size, overlap_copy=overlap)
        self.resumed_tier, self.run, self.sources = None, None, None
        self.weights_only = lc.fit_weights_only(trainer) is not False  # the durable file is read as fit reads it
        self._shards = trainer.strategy if isinstance(trainer.strategy, LocalShardSnapshots) else None
        self._target, self._in_place = partial(in_place_target, trainer), {}  # the module the durable IO is offered
        self._continue_lineage = partial(continue_lineage, trainer)
        if self._remove_hook is None and lc.requested_ckpt_path(trainer) == "last":
            choose = partial(self.choose, confirm=partial(confirm_last, trainer))  # "last" read headers only
            self._remove_hook = lc.substitute_checkpoint(trainer, choose)
        self.ring = replication.ring(
            self.replicas_option, trainer.num_nodes, self.rank, self.world_size, self.ring, trainer.node_rank
        )

    def teardown(self) -> None:
        replication.stop(self.replicator, quiet=True)  # after an exception the peers still train
        if self._remove_hook is not None:
            self._remove_hook()
            self._remove_hook = None

    def choose(self, durable: Optional[str], confirm: Optional[Confirm] = None) -> Chosen:
        """Every rank: this rank's memory snapshot and the loaded checkpoint, when every rank can obtain the same
        save, newer than ``durable`` (Lightning's "last", possibly ``None``), from its own memory or a peer's
        replica (``memory.recover``; the transfers: ``memory.peers``); else the durable checkpoint to restore:
        ``confirm()`` (the full "last" resolution, ``retention.last.confirm_last``: while the memory tier is
        asked first, "last" read the candidates' headers only), or ``durable`` without it."""
        read_run = lambda: (
            durable_run(durable, self.weights_only),
            durable_value(durable, ROOT_KEY, self.weights_only),
        )
        run, token = collective.on_rank_zero(read_run, _failure(f"read the run id of {durable}"))
        self._use_root(token if isinstance(token, str) else None)
        if run is None or self.store is None:  # no run id (a fresh start, another tool's file): no snapshot is ours
            self.resumed_tier = DURABLE if durable else None
            return durable if confirm is None else confirm()
        mine, offered = peers.offer(self.store, run, self._owners(), durable_step(durable, self.weights_only))
        offers = collective.gather(offered)
        newest_durable = max(o.durable_step for o in offers)
        outcome = plan_recovery(offers, self.world_size, newest_durable)
        snapshot, reason = self._recover(outcome, mine, run)
        if snapshot is not None and self._shards is not None:
            reason = self._shard_problems(self._shards, snapshot)
            snapshot = None if reason else snapshot
        if snapshot is None or not isinstance(outcome, RecoveryPlan):
            restored = durable if confirm is None else confirm()
            rank_zero_info(f"ExactResume: not resuming from the memory tier: {reason}; using {restored}")
            self.resumed_tier = DURABLE if restored else None
            return restored
        peers.settle(self.store, outcome, offered, self._owners())  # kept saves, newer replicas: another line's
        self._continue_dedupe(durable)
        # Each rank built its own snapshot; the save time that ranks compare at restore is rank 0's.
        _exact_state(snapshot.checkpoint)["saved_at"] = outcome.saved_at
        self.seq, self.run, self.sources = snapshot.seq, run, outcome.sources
        self.resumed_tier = REPLICA if outcome.from_peers else MEMORY
        moved = "".join(f"; rank {o}'s state from rank {h}'s memory" for h, o in outcome.transfers)
        rank_zero_info(
            f"ExactResume: resuming from the memory tier at step {snapshot.step} (durable: step {newest_durable}){moved}"
        )
        if self._shards is not None:  # the strategy loads no state itself: its shards go in place here
            return snapshot.path, self._shards.restore_local(snapshot.checkpoint)
        return snapshot.path, snapshot.checkpoint

    def _continue_dedupe(self, durable: Optional[str]) -> None:
        """A memory resume of a run whose durable saves are deduped continues their lineage (``cas``): its next save
        references the packs ``durable`` does, and its collections remove what its lineage left. A header that cannot
        be read costs only a full next save: said in the log, the resume goes on."""
        if durable is None:
            return
        try:
            self._continue_lineage(durable)
        except (LightningResumeError, OSError, ValueError) as err:
            rank_zero_info(
                f"ExactResume: the dedupe lineage of {durable} is not continued ({err}); its next save is whole"
            )

    def _shard_problems(self, shards: LocalShardSnapshots, snapshot: MemorySnapshot) -> str:
        """Every rank: why the planned snapshots of local shards cannot restore this run (another mesh at this world
        size, another model), in one line naming the ranks and paths; ``""`` when every rank's fits."""
        try:
            mine = [f"rank {self.rank}: {line}" for line in shards.check_local(snapshot.checkpoint)]
        except Exception as err:  # noqa: BLE001 - one rank's failure is every rank's (no rank waits in the gather)
            mine = [f"rank {self.rank}: its local shards could not be checked: {collective.describe(err)}"]
        everyone = [line for lines in collective.gather(mine) for line in lines]
        if not everyone:
            return ""
        more = f" (and {len(everyone) - 3} more)" if len(everyone) > 3 else ""
        shown = "; ".join(everyone[:3])
        return f"the snapshots' local shards do not fit this run's sharding (another mesh or model?): {shown}{more}"

    def _owners(self) -> list[int]:
        """The ranks whose replicas this rank holds: the ring's owners of this rank whose replica is in the slot. The
        node's ranks share the slot, so a replica another rank of this node holds is that rank's to offer."""
        if self.store is None:
            return []
        held = set(self.store.replica_owners())
        return [owner for owner in self.ring.owners if owner in held and owner != self.rank]

    def _recover(
        self, outcome: Outcome, mine: Optional[MemorySnapshot], run: str
    ) -> tuple[Optional[MemorySnapshot], str]:
        """Every rank: this rank's state of the planned save, or why no rank resumes from memory. Transfers only
        where some rank's state is on a peer; any rank's problem is every rank's (all resume from disk)."""
        if isinstance(outcome, NoRecovery):
            return None, outcome.reason
        problems: list[str] = []
        snapshot = mine
        if (outcome.from_peers or outcome.own_kept) and self.store is not None:
            try:
                snapshot, problems = peers.carry_out(outcome, self.store, self._transfers(), run, mine)
            except Exception as err:  # noqa: BLE001 - any rank's failure sends every rank to disk, named
                snapshot, problems = (
                    None,
                    [f"rank {self.rank}: the recovery from peers failed: {collective.describe(err)}"],
                )
        target = self._target()
        loaded, problems = self._load_checked(snapshot, run, target, problems)
        everyone = [line for lines in collective.gather(problems) for line in lines]
        if everyone:
            _left_part_loaded(target, loaded, "; ".join(everyone))
            return None, "; ".join(everyone)
        if target is not None and loaded is not None:
            partly.forget(target[0])  # a load into it succeeded (as the durable IO's does)
            self._in_place = {where[1]: digest for where, digest in loaded.in_place.items()}
        return loaded, ""

    def _load_checked(
        self, checked: Optional[MemorySnapshot], run: str, target: Optional[InPlaceTarget], problems: list[str]
    ) -> tuple[Optional[MemorySnapshot], list[str]]:
        """This rank's state of the plan, already checked (``peers``: its own snapshot in the offer, a received one
        as it arrived), its tensors read from the descriptor they were checked through without a second digest
        pass (``MemoryStore.load``); the module's weights straight into the module the durable IO was offered
        (``target``: ``protocols.in_place_target``), as the durable load would read them."""
        if problems or checked is None or self.store is None:
            return None, problems or [f"rank {self.rank}: no memory-tier state of the plan"]
        module, into = target if target is not None else (None, None)
        owner = "its caller" if module is None else f"the module {type(module).__name__}"
        try:
            loaded = self.store.load(run, into=into, into_owner=owner)
        except Exception as err:  # noqa: BLE001 - any rank's failure is every rank's (no rank waits in the gather)
            overwritten = getattr(err, "overwritten_in_place", 0)
            if module is not None and overwritten:
                partly.mark(module, self.store.path, str(err), overwritten)
            said = err if isinstance(err, (CheckpointCorruptError, PartialLoadError, OSError, ValueError)) else None
            why = str(said) if said is not None else collective.describe(err)
            return None, [f"rank {self.rank}: its memory-tier state {self.store.path} did not load: {why}"]
        if loaded is None or (loaded.step, loaded.seq) != (checked.step, checked.seq):
            got = "nothing" if loaded is None else f"step {loaded.step} (save {loaded.seq})"
            return loaded, [f"rank {self.rank}: {self.store.path} changed after its check: {got}"]
        return loaded, []

    def loaded_in_place(self, trainer: pl.Trainer) -> dict[str, tuple[str, str]]:
        """The weights the resume read straight into the module, by state-dict name, with the file's recorded
        ``(algorithm, digest)`` (``protocols.loaded_in_place``): the memory tier's load when it supplied the
        resume, else the durable IO's."""
        if self.resumed_tier in (MEMORY, REPLICA):
            return dict(self._in_place)
        return io_loaded_in_place(trainer)

    def _transfers(self) -> Any:
        """The transfer group: the ring's (made at setup), else (replicas now off, replicas of an earlier launch
        still held) one made here, collectively: every rank asks at the same point, as every rank has the plan."""
        if self.ring.group is None and self._group is None:
            self._group = transport.transfer_group()
        return self.ring.group if self.ring.group is not None else self._group

    def _use_root(self, token: Optional[str]) -> None:
        """Snapshots go to (and are read from) the fallback root of ``token`` when it names one, else this user's
        root; the store is rebuilt only when that changes."""
        root = (fallback_root(self.memory_dir, token) if token else None) or memory_root(self.memory_dir)
        self.root_token = token if root != memory_root(self.memory_dir) else None
        if self.store is not None and root != self.root:
            self.store.close()  # leaves what the old root holds as it is
            self.store = MemoryStore(
                root, slot_key(self.directory), self.rank, self.world_size, overlap_copy=self._overlap
            )
        self.root = root

    def start(self, restored_run: Optional[str], restored_token: Optional[str] = None) -> None:
        """At the start of training (every rank): the run's id, the restored checkpoint's (``restored_run``)
        or, at a fresh start, a new one; the root of its snapshots (:meth:`_choose_root`); and a snapshot
        that is not the resume source belongs to a line of training this run left (older than the durable
        checkpoint it resumed from, another run's, or a fresh start): it is dropped."""
        if self.resumed_tier in (MEMORY, REPLICA):
            self._start_replication()
            return
        if self.store is not None:
            self.store.free()
        self.seq = 0
        self.run = restored_run or collective.broadcast(secrets.token_hex(8))
        self._choose_root(restored_token)
        self._start_replication()

    def _choose_root(self, restored_token: Optional[str]) -> None:
        """Every rank: the root of this run's snapshots: the fallback root the restored checkpoint names
        (``restored_token``), else this user's root, unless another user holds its name on any rank's node:
        then every rank uses one fallback root of a random name, said once."""
        if isinstance(restored_token, str) and fallback_root(self.memory_dir, restored_token) is not None:
            self._use_root(restored_token)
            return
        primary = memory_root(self.memory_dir)
        fresh = collective.broadcast(secrets.token_hex(8))  # every rank the same name
        reason = squatted(primary)
        held = [(rank, why) for rank, why in enumerate(collective.gather(reason)) if why is not None]
        if held:
            rank_zero_warn(
                f"ExactResume: {primary} {held[0][1]} (rank {held[0][0]}), not this user's private directory:"
                f" another user may have made it first; memory-tier snapshots go to"
                f" {fallback_root(self.memory_dir, fresh)} instead",
                category=ExactResumeWarning,
            )
        self._use_root(fresh if held else None)

    def _start_replication(self) -> None:
        """This fit's replicator, on the store of the root chosen (once per fit: a stop tells the holders)."""
        replication.stop(self.replicator, quiet=True)
        self.replicator = replication.start(self.store, self.ring)
        if self.replicator is not None:
            rank_zero_info(f"ExactResume: each rank's memory snapshots also go to {self.replicas} other node(s)")

    @property
    def replicas(self) -> int:
        """How many other nodes hold each rank's snapshot (resolved at :meth:`setup`)."""
        return self.ring.replicas

    def offer(self, trainer: pl.Trainer) -> Optional[Offer]:
        """The durable IO's newest staged save on this rank (``staging.lending``), or ``None``: read before and after a
        durable save, it tells whether that save staged the state here (only rank 0 writes a DDP checkpoint)."""
        return None if self._lending is None else self._lending.newest()

    def save(self, trainer: pl.Trainer, borrow: Optional[Offer] = None, replicate: bool = True) -> Optional[int]:
        """Every rank: snapshot the full checkpoint into its slot; the bytes written, or ``None`` (warned)
        when shared memory is too small, the root cannot be trusted or the write failed (training goes on;
        the durable tier still saves). ``borrow``: the offer of the durable save just taken at this step
        boundary: the tensors it staged are written from there, not copied again. ``replicate``: once
        committed, the snapshot goes to its holders in the background (with replicas on)."""
        self.dumping = True  # not a durable save: nothing waits for the durable tier's write
        try:
            checkpoint = lc.dump_checkpoint(trainer)  # every rank: the callbacks' state_dict gathers across ranks
        finally:
            self.dumping = False
        if self._shards is not None:  # one file per rank still: this rank's shards, as plain tensors
            checkpoint = self._shards.memory_snapshot(checkpoint)
        if self.store is None or self.run is None:
            return None
        self.seq += 1
        try:
            if self.seq == 1:
                self.store.clean_stale()  # after other runs of this user
            replicate = replicate and self.replicator is not None and replication.agree(self.replicator)
            after = replication.after_commit(self.replicator) if replicate else None
            return self.store.save(
                checkpoint, trainer.global_step, self.seq, self.run, borrow=borrow, after_commit=after
            )
        except NotEnoughSharedMemory as err:
            if not self.warned_full:
                warnings.warn(f"ExactResume: {err}", ExactResumeWarning, stacklevel=2)
                self.warned_full = True
        except OSError as err:  # UntrustedDirectory among them: said once, the tier stays off
            if not self._warned_failed:
                warnings.warn(f"ExactResume: memory-tier snapshot failed ({err})", ExactResumeWarning, stacklevel=2)
                self._warned_failed = True
        return None

    @property
    def borrowed_bytes(self) -> int:
        """Bytes the newest snapshot wrote from a durable save's staging instead of copying them."""
        return 0 if self.store is None else self.store.last_borrowed_bytes

    def flush(self, timeout: float = FLUSH_TIMEOUT_S) -> None:
        """After an exception, before the process exits: let the snapshot being written commit (its worker is a
        daemon thread that exit would cut short, losing the newest snapshot to the failure it is for)."""
        replication.stop(self.replicator, quiet=True)
        if self.store is None:
            return
        try:
            if not self.store.wait(timeout):
                warnings.warn(
                    f"ExactResume: the memory-tier snapshot {self.store.path} was not committed within {timeout:.0f}s"
                    " of the exception; a relaunch resumes from the one before it",
                    ExactResumeWarning,
                    stacklevel=2,
                )
        except (AsyncWriteError, OSError) as err:  # the training error is the one raised; this one is reported
            warnings.warn(f"ExactResume: memory-tier snapshot failed ({err})", ExactResumeWarning, stacklevel=2)

    def free(self) -> None:
        """A clean end of training: the durable tier has the final state; give the memory back."""
        replication.stop(self.replicator)  # first: no replica arrives after the slot is freed
        if self.store is not None:
            self.store.free()


def _left_part_loaded(target: Optional[InPlaceTarget], loaded: Optional[MemorySnapshot], reason: str) -> None:
    """A state read into the module that the ranks then did not resume (another rank's problem): the module holds
    the snapshot's weights until the durable load replaces them; a fit on it, if nothing is restored, refuses
    (``format.partial``) rather than train from them as if fresh."""
    if target is not None and loaded is not None and loaded.in_place:
        partly.mark(target[0], loaded.path, f"the memory-tier resume was abandoned: {reason}", len(loaded.in_place))


def _exact_state(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    state = checkpoint.get("callbacks", {}).get("ExactResume")
    return state if isinstance(state, dict) else {}


def _failure(what: str) -> collective.Failure:
    def failure(problems: Mapping[int, str]) -> BaseException:
        return ConfigurationError("ExactResume(memory_tier=...)", [f"could not {what}: {problems}"])

    return failure


def unsupported(trainer: pl.Trainer) -> bool:
    """The memory tier keeps one checkpoint per rank: the full one (DDP), or its local shards under a strategy that
    can snapshot and restore them (``protocols.LocalShardSnapshots``); not for the other strategies whose ranks
    hold shards (``FSDPStrategy``, DeepSpeed)."""
    strategy = trainer.strategy
    if trainer.world_size <= 1 or isinstance(strategy, LocalShardSnapshots):
        return False
    return not type(strategy).__name__.startswith("DDP")


def warn_sharded(trainer: pl.Trainer) -> bool:
    """:func:`unsupported`, said once."""
    if unsupported(trainer):
        rank_zero_warn(
            f"ExactResume(memory_tier=...) supports single-device, DDP and ShardedModelParallelStrategy runs, not"
            f" {type(trainer.strategy).__name__};"
            " the memory tier is off for this run",
            category=ExactResumeWarning,
        )
        return True
    return False
