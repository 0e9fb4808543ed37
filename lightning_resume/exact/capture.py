"""What ``ExactResume`` adds to a checkpoint: every rank's RNG streams, data position, logged metrics and fingerprint.

Gathers, on each rank, the state Lightning leaves out, aligned with the last batch actually trained on
(the batches Lightning prefetched are stored, not skipped), and a signature of the run's structure
(loaders, model, optimizers) that a resume must match. The checkpoint holds every rank's part (only
rank 0 writes the file). Reads the trainer through ``_compat.lightning``; decides nothing.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

from lightning_resume import collective
from lightning_resume._compat import lightning as lc
from lightning_resume.exact import lightning_gaps
from lightning_resume.exact.state import ddp_buckets, rank_local
from lightning_resume.exact.state.data import loader_signature, loader_state, order_record
from lightning_resume.exact.state.fingerprint import digest, fingerprint
from lightning_resume.exact.state.rng import capture_rng
from lightning_resume.exact.state.user import UserState, metrics_held
from lightning_resume.exact.state.user import capture as capture_user
from lightning_resume.protocols import DigestingCheckpointIO

FORMAT_VERSION = 1
"""Layout of the state below; a resume refuses another."""

AT_STEP_BOUNDARY = "step_boundary"
INSIDE_STEP = "inside_training_step"
INSIDE_VALIDATION = "inside_validation"
OUTSIDE_FIT = "outside_fit"
"""Where in the loop a state was captured. Only a step boundary (after a batch, after a validation run,
at an epoch's end) can resume exactly: a state captured inside a step (a signal handler's save, an
exception hook) or inside validation has work half done that no checkpoint holds. A checkpoint saved outside
``fit`` (``trainer.save_checkpoint()`` after training) holds no training position at all."""


def checkpoint_state(
    trainer: pl.Trainer,
    after_batch: bool,
    with_fingerprint: bool,
    schedule: dict[str, Any],
    captured_at: str = AT_STEP_BOUNDARY,
    saved_at: Optional[float] = None,
    user: Optional[UserState] = None,
) -> dict[str, Any]:
    """The ``ExactResume`` entry of a checkpoint: every rank's state (a collective) and the run's signature.

    ``after_batch``: the save happens right after a training batch (so validation may be due next).
    ``captured_at``: where in the loop (``AT_STEP_BOUNDARY``, ``INSIDE_STEP``, ``INSIDE_VALIDATION``).
    ``saved_at``: the wall time of the save (default ``time.time()``), on the clock of the failure history.
    ``user``: the state users keep outside Lightning (``state.user.find``), saved per rank.
    """
    local = capture_rank(trainer, after_batch, with_fingerprint, user)
    return {
        "format": FORMAT_VERSION,
        "captured_at": captured_at,
        "saved_at": time.time() if saved_at is None else saved_at,
        "schedule": schedule,
        "world_size": trainer.world_size,
        "signature": signature(trainer),
        "last_saved": lc.last_saved_steps(trainer),
        lightning_gaps.KEY: lightning_gaps.capture(trainer, after_batch),
        "accumulate": int(trainer.accumulate_grad_batches),
        ddp_buckets.KEY: ddp_buckets.capture(trainer),  # every rank is here: a pending rebuild may broadcast
        "ranks": collective.gather(local, trainer.world_size),
    }


def capture_rank(
    trainer: pl.Trainer,
    after_batch: bool,
    with_fingerprint: bool,
    user: Optional[UserState] = None,
) -> dict[str, Any]:
    """This rank's RNG streams, loader positions, prefetched batches and where in the epoch it stands."""
    loaders = lc.train_loaders(trainer)
    states = [loader_state(dl) for dl in loaders]
    prefetched = lc.prefetched_batches(trainer)
    local = {
        "rank": trainer.global_rank,
        "rng": capture_rng(),
        "loaders": states,
        "orders": [order_record(dl) for dl in loaders],  # what an elastic resume rebuilds the epoch from
        "prefetched": prefetched,
        "epoch": trainer.current_epoch,
        "epoch_exhausted": lc.epoch_exhausted(trainer),
        "validation_pending": after_batch and lc.validation_due(trainer),
        "metrics": decision_metrics(trainer),
        lightning_gaps.KEY: lightning_gaps.capture_rank(trainer),  # self.log's epoch so far, cycled loaders
        "buffers": rank_local.differing_from_rank_zero(trainer.lightning_module) if replicated(trainer) else {},
        "user": capture_user(user, lightning_resets(trainer, user)),
    }
    if with_fingerprint:
        bulk = not files_prove_tensors(trainer)  # else compared with the loaded checkpoint at restore instead
        local["fingerprint"] = fingerprint_of(trainer, local["rng"], [states, prefetched], bulk)
    return local


def lightning_resets(trainer: pl.Trainer, user: Optional[UserState]) -> list[Any]:
    """The held metrics Lightning resets before their next update (those logged in validation): saved as reset,
    since the state they hold now is not the one the next update sees."""
    return lc.metrics_lightning_resets(trainer) if metrics_held(user) else []


def files_prove_tensors(trainer: pl.Trainer) -> bool:
    """The checkpoint files record every tensor's digest and verify it on load (``SafetensorsCheckpointIO``),
    so hashing the weights and optimizer state at each save, on the training thread, would prove nothing
    more: the restored state is compared with the loaded, verified checkpoint instead."""
    io = trainer.strategy.checkpoint_io
    return isinstance(io, DigestingCheckpointIO) and io.records_digests is True


def replicated(trainer: pl.Trainer) -> bool:
    """Several ranks each hold the whole module and the checkpoint holds rank 0's (DDP, ddp_spawn): the
    buffers other ranks hold differently must be kept per rank. Sharded strategies save every rank's part."""
    strategy = trainer.strategy
    return trainer.world_size > 1 and isinstance(strategy, DDPStrategy) and not isinstance(strategy, DeepSpeedStrategy)


def sharded(trainer: pl.Trainer) -> bool:
    """Each rank holds a shard of the weights and optimizer state (FSDP, model parallel, DeepSpeed): a rank's
    fingerprint is of its shard, which another world size changes."""
    return isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy, DeepSpeedStrategy))


def decision_metrics(trainer: pl.Trainer) -> dict[str, Any]:
    """``trainer.callback_metrics`` as plain CPU values: what a checkpoint callback's next save decision reads
    (a monitored metric logged at the last validation), which Lightning's checkpoints leave out."""
    return {
        str(name): value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
        for name, value in trainer.callback_metrics.items()
    }


def fingerprint_of(trainer: pl.Trainer, rng: Any, data: Any, bulk: bool = True) -> dict[str, str]:
    """The fingerprint of this rank's weights and optimizer state (``bulk``), RNG, data position, step, and of
    each module buffer checkpoints do not hold (``persistent=False``)."""
    module = trainer.lightning_module
    state = module.state_dict()
    unsaved = {name: buffer for name, buffer in module.named_buffers() if name not in state}
    optimizers = [opt.state_dict() for opt in trainer.optimizers] if bulk else None
    step = trainer.global_step
    return fingerprint(state if bulk else None, optimizers, rng, data, step, unsaved)


def signature(trainer: pl.Trainer) -> dict[str, Any]:
    """What must be equal between the saving and the resuming run for the saved state to apply."""
    module = trainer.lightning_module
    return {
        "loaders": [loader_signature(dl) for dl in lc.train_loaders(trainer)],
        "model": digest([(n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]),
        "optimizers": [
            [type(opt).__name__, [len(g["params"]) for g in opt.param_groups]] for opt in trainer.optimizers
        ],
    }
