"""Resuming on another number of ranks (``ExactResume(elastic=...)``): the mechanism in a Lightning run.

``DealtPosition`` is the variant of ``restore``'s one sequence for another world size (that sequence,
``restore_position_and_rng``, alone fixes the order of random draws). Every rank rebuilds each saving
rank's order of the interrupted epoch from what the checkpoint recorded (``capture.order_record`` per
rank: the distributed sampler's arguments and epoch, or the plan an earlier elastic resume dealt) and the
batches its loader had handed out, deals the untrained rest to the new ranks (``state.elastic``: every
sample once, the rule there), makes this rank's sampler yield its part of it (``samplers.install_plan``)
and tells Lightning the epoch's new length. RNG streams: new rank ``r`` starts from saved rank ``r % W``'s;
ranks ``r >= W`` then seed every stream from ``elastic.derived_seed`` (a digest of that state and of the
move), so no two ranks draw alike and the same elastic resume draws the same. A checkpoint written inside
a planned epoch, resumed on the same world size, takes the ordinary exact path with the plan put back
(``put_back_plan``). Decides nothing the policy does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import GradientAccumulationScheduler

from lightning_resume import collective
from lightning_resume._compat import lightning as lc
from lightning_resume._compat import torchdata as td
from lightning_resume.errors import CheckpointCorruptError, ResumeMismatchError
from lightning_resume.exact.state import elastic as policy
from lightning_resume.exact.state import saved_numbers
from lightning_resume.exact.state.data import batching, distributed_sampler
from lightning_resume.exact.state.rng import reseed
from lightning_resume.exact.state.samplers import EpochPlan, install_plan

ElasticMode = Union[bool, Literal["keep_global_batch"]]
"""``False``: a changed world size is refused (``strict``) or resumed approximately; ``True``: resumed with
every sample of the epoch once and the per-rank batch kept; ``"keep_global_batch"``: the same with gradient
accumulation changed so that the global batch stays."""

Undo = Callable[[], None]


@dataclass
class Afterwards:
    """What a restore changed for a while: put back at the end of the resumed epoch, and at teardown."""

    at_epoch_end: list[Undo] = field(default_factory=list)
    at_teardown: list[Undo] = field(default_factory=list)

    def epoch_ended(self) -> None:
        for undo in reversed(self.at_epoch_end):
            undo()
        self.at_epoch_end.clear()

    def teardown(self) -> None:
        self.epoch_ended()
        for undo in reversed(self.at_teardown):
            undo()
        self.at_teardown.clear()


def check_mode(elastic: Any) -> list[str]:
    """What is wrong with an ``elastic`` argument (empty: nothing)."""
    if elastic is True or elastic is False or elastic == policy.KEEP_GLOBAL_BATCH:
        return []
    return [f"elastic={elastic!r}: pass True, False or 'keep_global_batch'"]


FIX = (
    "Relaunch on the checkpoint's world size, or use a map-style dataset with a distributed sampler (Lightning's"
    " default with use_distributed_sampler=True, or torchdata's StatefulDistributedSampler) and one train loader."
)


def saved_batch_size(saved: Mapping[str, Any], loader: Any) -> int:
    """The per-rank batch size of the saving run: its signature's, or, where that recorded ``None`` (the batch
    sampler case of ``batching``), this loader's batch sampler's (made by the same loader code; ``unremappable``
    refuses a loader without a fixed size)."""
    recorded = saved["signature"]["loaders"][0].get("batch_size")
    size = recorded if recorded is not None else batching(loader)[0]
    assert size is not None  # unremappable() said so
    return int(size)


def unremappable(trainer: pl.Trainer, saved: Mapping[str, Any], mode: ElasticMode) -> list[str]:
    """Why this checkpoint's epoch cannot be dealt to this run's ranks, one line each (empty: it can)."""
    loaders = lc.train_loaders(trainer)
    out = []
    if len(loaders) != 1:
        out.append(f"an elastic resume deals out one train loader; this run has {len(loaders)}")
    elif distributed_sampler(loaders[0]) is None:
        kind = type(getattr(loaders[0], "sampler", loaders[0])).__name__
        out.append(f"train loader 0 has no distributed sampler ({kind}), so its order cannot be dealt to other ranks")
    elif batching(loaders[0])[0] is None:  # batches of varying size: positions in samples are unknown
        kind = type(getattr(loaders[0], "batch_sampler", None)).__name__
        out.append(f"train loader 0 batches with {kind}, which has no fixed batch_size, so its batches cannot be dealt")
    live = dataset_length(trainer)
    for rank, state in enumerate(saved["ranks"]):
        orders = state.get("orders") or [{}]
        if len(orders) == 1 and "length" not in orders[0]:
            what = orders[0].get("sampler", "a checkpoint written before elastic resume existed")
            out.append(f"saved rank {rank}: its loader's position cannot be remapped ({what})")
            break
        if live is not None and "length" in orders[0] and orders[0]["length"] != live:
            out.append(
                f"saved rank {rank}: orders[0].length = {orders[0]['length']}, its epoch's samples, but this run's"
                f" train dataset has {live}: the order it recorded is not of this dataset"
            )
            break
    if mode == policy.KEEP_GLOBAL_BATCH:
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's connector
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in callbacks):
            out.append("elastic='keep_global_batch' cannot change a GradientAccumulationScheduler's accumulation")
    return out


BAD_NUMBERS_FIX = (
    "Resume from another checkpoint (lightning-resume verify checks one), or delete the callbacks.ExactResume"
    " entry to resume without the exact position."
)


def refuse_bad_numbers(trainer: pl.Trainer, saved: Mapping[str, Any], may_move: bool) -> None:
    """Before the restore uses any of them: ``CheckpointCorruptError`` naming each number of the state that no
    ``ExactResume`` writes (``saved_numbers``), in time and memory bounded by the state's size. ``may_move``:
    another world size would be dealt out (``elastic``, or ``strict=False``)."""
    moved = may_move and saved.get("world_size") != trainer.world_size
    bad = saved_numbers.problems(saved, saved_numbers.Live(moved, dataset_length(trainer)), td.batches_yielded)
    if bad:
        lines = "".join(f"\n  - {line}" for line in bad)
        what = f"its ExactResume state holds numbers no ExactResume writes (edited or damaged):{lines}"
        raise CheckpointCorruptError(str(trainer.ckpt_path or "the checkpoint"), f"{what}\n{BAD_NUMBERS_FIX}")


def dataset_length(trainer: pl.Trainer) -> Optional[int]:
    """The length of train loader 0's dataset where a distributed sampler draws from it, else ``None``."""
    loaders = lc.train_loaders(trainer)
    sampler = distributed_sampler(loaders[0]) if loaders else None
    try:
        return None if sampler is None else len(sampler.dataset)
    except TypeError:
        return None


def rank_orders(saved: Mapping[str, Any], batch_size: int) -> tuple[list[policy.RankOrder], int]:
    """Every saving rank's order of the interrupted epoch with what it trained (``batch_size`` samples a
    batch), and the batches of the epoch they had trained."""
    orders, batches = [], 0
    world = int(saved["world_size"])
    dealt: dict[tuple[policy.OrderSpec, int], list[list[int]]] = {}  # the epoch's order made once for all ranks
    for rank, state in enumerate(saved["ranks"]):
        record = state["orders"][0]
        yielded = td.batches_yielded(state["loaders"][0] or {})
        plan = record.get("plan")
        if plan is not None and int(plan["epoch"]) == int(record["epoch"]):
            epoch_plan = EpochPlan.from_state(plan)
            indices, start = epoch_plan.indices, epoch_plan.start_batch
        else:
            spec = policy.OrderSpec(record["length"], record["shuffle"], record["seed"], record["drop_last"])
            key = (spec, int(record["epoch"]))
            if key not in dealt:
                dealt[key] = spec.every_rank(world, key[1])
            indices, start = dealt[key][rank], 0
        orders.append(policy.RankOrder(indices, min(len(indices), yielded * batch_size)))
        batches = max(batches, start + yielded)
    return orders, batches


@dataclass(frozen=True)
class Move:
    """A resume on another world size, as the report says it."""

    old_world: int
    new_world: int
    accumulate: tuple[int, int]
    batch_size: int
    epoch: int
    deal: Optional[policy.Deal]

    def global_batch(self) -> tuple[int, int]:
        (before, after), b = self.accumulate, self.batch_size
        return self.old_world * before * b, self.new_world * after * b

    def sentence(self) -> str:
        before, after = self.global_batch()
        if self.deal is None:
            epoch = f"epoch {self.epoch} had ended, so the next one starts in the sampler's order for {self.new_world}"
        else:
            extra = (
                f"; {len(self.deal.padded)} of them trained twice so that every rank has as many"
                if self.deal.padded
                else f"; {len(self.deal.dropped)} left out (the sampler's drop_last)"
                if self.deal.dropped
                else ""
            )
            epoch = (
                f"the {self.deal.untrained} samples of epoch {self.epoch} not yet trained are dealt to the"
                f" {self.new_world} rank{'s' * (self.new_world != 1)}, every sample of the epoch once{extra}"
            )
        accumulate = f", accumulate_grad_batches {self.accumulate[0]} -> {self.accumulate[1]}" * (
            self.accumulate[0] != self.accumulate[1]
        )
        return (
            f"resumed a checkpoint of {self.old_world} ranks on {self.new_world}: {epoch}; global batch {before} ->"
            f" {after} (per-rank batch {self.batch_size}{accumulate}); not bitwise the run on {self.old_world} ranks"
        )


class DealtPosition:
    """Another world size, as a ``restore.Position`` of the one restore sequence: the untrained rest of the
    interrupted epoch dealt to this run's ranks (every sample once), new rank ``r`` continuing saved rank
    ``r % W``'s streams and, past the old world, reseeded from them (``derived_seed``); the accumulation that
    keeps the global batch (``keep_global_batch``) set after the due validation."""

    def __init__(self, saved: Mapping[str, Any], accumulate: tuple[int, int], loader: Any, batch_size: int):
        self.saved, self.accumulate, self.loader, self.batch_size = saved, accumulate, loader, batch_size
        self.old_world = int(saved["world_size"])
        self.dealt: Optional[policy.Deal] = None  # by ``place``, inside an epoch under way

    @classmethod
    def prepare(cls, trainer: pl.Trainer, saved: Mapping[str, Any], mode: ElasticMode) -> DealtPosition:
        """Check, on every rank alike, that the checkpoint's epoch can be dealt to this run's ranks (else
        ``ResumeMismatchError``), and settle the accumulation from now on."""
        problems = collective.agreed(unremappable(trainer, saved, mode))
        if problems:
            raise ResumeMismatchError(str(trainer.ckpt_path or "the checkpoint"), problems, FIX)
        accumulate = _accumulation(trainer, saved, mode)
        loader = lc.train_loaders(trainer)[0]
        return cls(saved, accumulate, loader, saved_batch_size(saved, loader))  # not the signature's alone

    def place(self, trainer: pl.Trainer, mine: Mapping[str, Any], afterwards: Afterwards) -> Optional[EpochPlan]:
        if mine["epoch_exhausted"]:
            return None  # the next epoch starts in the sampler's order for the new world size
        orders, batches = rank_orders(self.saved, self.batch_size)
        sampler = distributed_sampler(self.loader)
        assert sampler is not None  # unremappable() said so
        self.dealt = policy.deal(policy.untrained(orders), trainer.world_size, bool(sampler.drop_last))
        plan = EpochPlan(trainer.current_epoch, self.dealt.per_rank[trainer.global_rank], batches)
        afterwards.at_teardown.append(install_plan(sampler, plan))
        lc.set_sampler_epoch([self.loader], trainer.current_epoch)
        lc.restart_train_iterator(trainer)
        return plan

    def reseed(self, trainer: pl.Trainer, mine: Mapping[str, Any]) -> None:
        rank = trainer.global_rank
        if rank >= self.old_world:
            reseed(policy.derived_seed(mine["rng"], self.old_world, trainer.world_size, rank))

    def finish(self, trainer: pl.Trainer) -> None:
        if self.accumulate[1] != trainer.accumulate_grad_batches:
            lc.set_accumulation(trainer, self.accumulate[1])

    def move(self, trainer: pl.Trainer, mine: Mapping[str, Any]) -> Move:
        """The move, as the report says it (after the sequence: the deal is known)."""
        epoch = int(mine.get("epoch", trainer.current_epoch))
        return Move(self.old_world, trainer.world_size, self.accumulate, self.batch_size, epoch, self.dealt)


def _accumulation(trainer: pl.Trainer, saved: Mapping[str, Any], mode: ElasticMode) -> tuple[int, int]:
    """Gradient accumulation in the saving run and from now on (``keep_global_batch``: the global batch kept)."""
    before = int(saved.get("accumulate", trainer.accumulate_grad_batches))
    if mode != policy.KEEP_GLOBAL_BATCH:
        return before, int(trainer.accumulate_grad_batches)
    try:
        return before, policy.accumulation(int(saved["world_size"]), before, trainer.world_size)
    except ValueError as err:
        raise ResumeMismatchError(str(trainer.ckpt_path or "the checkpoint"), [str(err)], FIX) from None


def keep_accumulation(trainer: pl.Trainer, saved: Mapping[str, Any], mode: ElasticMode) -> None:
    """On the same world size, ``keep_global_batch`` keeps the accumulation an earlier elastic resume chose."""
    if mode == policy.KEEP_GLOBAL_BATCH and "accumulate" in saved:
        lc.set_accumulation(trainer, int(saved["accumulate"]))


def put_back_plan(trainer: pl.Trainer, mine: Mapping[str, Any], afterwards: Afterwards) -> Optional[EpochPlan]:
    """Same world size, a checkpoint written inside an epoch an elastic resume dealt: the plan goes back on
    this rank's sampler before its position is loaded (the position counts indices of the plan)."""
    if mine["epoch_exhausted"]:
        return None
    for loader, record in zip(lc.train_loaders(trainer), mine.get("orders") or [], strict=False):
        plan, sampler = (record or {}).get("plan"), distributed_sampler(loader)
        if plan is not None and sampler is not None and int(plan["epoch"]) == trainer.current_epoch:
            epoch_plan = EpochPlan.from_state(plan)
            afterwards.at_teardown.append(install_plan(sampler, epoch_plan))
            return epoch_plan
    return None


def planned_length(trainer: pl.Trainer, plan: EpochPlan, afterwards: Afterwards) -> None:
    """Tell Lightning the planned epoch's length (after the iterator restart, which resets the fetcher's)."""
    loader = lc.train_loaders(trainer)[0]
    size, drop_last = batching(loader)  # a batch sampler's, where Lightning made one (``batching``)
    length = plan.start_batch + policy.epoch_batches(len(plan.indices), size or 1, drop_last)
    afterwards.at_epoch_end.append(lc.set_epoch_length(trainer, length))
