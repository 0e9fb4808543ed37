"""lightning-resume: a Lightning run that survives any stop and continues bit for bit.

The public API, nothing else; README.md's "API" section lists the same names, one line each. Names
are imported on first use (PEP 562), so ``import lightning_resume`` is cheap and loads neither
Lightning nor ``torch.distributed.checkpoint`` until a name that needs them is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

_SOURCES: dict[str, str] = {
    "ActivationCheckpointingDDPStrategy": "lightning_resume.activation.strategies",
    "ActivationCheckpointingFSDPStrategy": "lightning_resume.activation.strategies",
    "ActivationCheckpointingStrategy": "lightning_resume.activation.strategies",
    "AsyncShardedSaver": "lightning_resume.sharded.background",
    "AsyncWriteError": "lightning_resume.errors",
    "AsyncWriteWarning": "lightning_resume.errors",
    "BlockSelection": "lightning_resume.activation.policy",
    "CheckpointCorruptError": "lightning_resume.errors",
    "CheckpointPlan": "lightning_resume.activation.policy",
    "CheckpointRecord": "lightning_resume.retention.policy",
    "ConfigurationError": "lightning_resume.errors",
    "ExactResume": "lightning_resume.exact.callback",
    "ExactResumeWarning": "lightning_resume.errors",
    "Formula": "lightning_resume.schedule.formulas",
    "HistoryWarning": "lightning_resume.errors",
    "KeepDecision": "lightning_resume.retention.policy",
    "LightningResumeError": "lightning_resume.errors",
    "LightningResumeWarning": "lightning_resume.errors",
    "MemoryTierOptions": "lightning_resume.schedule.options",
    "Mirror": "lightning_resume.retention.tiers",
    "NoLoadableCheckpointError": "lightning_resume.errors",
    "PartialLoadError": "lightning_resume.errors",
    "PickledCheckpointError": "lightning_resume.errors",
    "PreemptionFlag": "lightning_resume.schedule.preemption",
    "PreemptionOptions": "lightning_resume.schedule.options",
    "PreemptionWarning": "lightning_resume.errors",
    "RanksOutOfStepError": "lightning_resume.errors",
    "RemoteOptions": "lightning_resume.io.options",
    "ResumableDataset": "lightning_resume.exact.state.data",
    "ResumableIterableDataset": "lightning_resume.exact.state.data",
    "ResumeMismatchError": "lightning_resume.errors",
    "ResumeReport": "lightning_resume.exact.restore",
    "RetentionCheckpoint": "lightning_resume.retention.checkpoint",
    "RetentionPolicy": "lightning_resume.retention.policy",
    "RetentionWarning": "lightning_resume.errors",
    "SafetensorsCheckpointIO": "lightning_resume.io.plugin",
    "ScheduleOptions": "lightning_resume.schedule.options",
    "ShardedCheckpointIO": "lightning_resume.io.sharded_strategy",
    "ShardedCheckpointWarning": "lightning_resume.errors",
    "ShardedModelParallelStrategy": "lightning_resume.io.sharded_strategy",
    "ShardedSaveError": "lightning_resume.errors",
    "ShardedSaveHandle": "lightning_resume.sharded.background",
    "SkippedCheckpointWarning": "lightning_resume.errors",
    "UnencodableValueError": "lightning_resume.errors",
    "UnknownTypeError": "lightning_resume.errors",
    "UnsafeCheckpointError": "lightning_resume.errors",
    "VersionWarning": "lightning_resume.errors",
    "WriterProcessDied": "lightning_resume.errors",
    "accept_partial": "lightning_resume.format.partial",
    "daly_interval": "lightning_resume.schedule.formulas",
    "expected_waste": "lightning_resume.schedule.formulas",
    "load_full": "lightning_resume.sharded.api",
    "load_sharded": "lightning_resume.sharded.api",
    "measure_saved_bytes": "lightning_resume.activation.measure",
    "newest_committed": "lightning_resume.io.resolve",
    "newest_verified": "lightning_resume.io.resolve",
    "plan_checkpointing": "lightning_resume.activation.policy",
    "register_converter": "lightning_resume.format.codec",
    "save_sharded": "lightning_resume.sharded.api",
    "save_sharded_async": "lightning_resume.sharded.background",
    "verify": "lightning_resume.io.verify",
    "verify_sharded": "lightning_resume.sharded.api",
    "young_interval": "lightning_resume.schedule.formulas",
}

__all__ = sorted(_SOURCES)


def __getattr__(name: str) -> Any:
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_resume' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from lightning_resume.activation.measure import measure_saved_bytes
    from lightning_resume.activation.policy import BlockSelection, CheckpointPlan, plan_checkpointing
    from lightning_resume.activation.strategies import (
        ActivationCheckpointingDDPStrategy,
        ActivationCheckpointingFSDPStrategy,
        ActivationCheckpointingStrategy,
    )
    from lightning_resume.errors import (
        AsyncWriteError,
        AsyncWriteWarning,
        CheckpointCorruptError,
        ConfigurationError,
        ExactResumeWarning,
        HistoryWarning,
        LightningResumeError,
        LightningResumeWarning,
        NoLoadableCheckpointError,
        PartialLoadError,
        PickledCheckpointError,
        PreemptionWarning,
        RanksOutOfStepError,
        ResumeMismatchError,
        RetentionWarning,
        ShardedCheckpointWarning,
        ShardedSaveError,
        SkippedCheckpointWarning,
        UnencodableValueError,
        UnknownTypeError,
        UnsafeCheckpointError,
        VersionWarning,
        WriterProcessDied,
    )
    from lightning_resume.exact.callback import ExactResume
    from lightning_resume.exact.restore import ResumeReport
    from lightning_resume.exact.state.data import ResumableDataset, ResumableIterableDataset
    from lightning_resume.format.codec import register_converter
    from lightning_resume.format.partial import accept_partial
    from lightning_resume.io.options import RemoteOptions
    from lightning_resume.io.plugin import SafetensorsCheckpointIO
    from lightning_resume.io.resolve import newest_committed, newest_verified
    from lightning_resume.io.sharded_strategy import ShardedCheckpointIO, ShardedModelParallelStrategy
    from lightning_resume.io.verify import verify
    from lightning_resume.retention.checkpoint import RetentionCheckpoint
    from lightning_resume.retention.policy import CheckpointRecord, KeepDecision, RetentionPolicy
    from lightning_resume.retention.tiers import Mirror
    from lightning_resume.schedule.formulas import Formula, daly_interval, expected_waste, young_interval
    from lightning_resume.schedule.options import MemoryTierOptions, PreemptionOptions, ScheduleOptions
    from lightning_resume.schedule.preemption import PreemptionFlag
    from lightning_resume.sharded.api import load_full, load_sharded, save_sharded, verify_sharded
    from lightning_resume.sharded.background import AsyncShardedSaver, ShardedSaveHandle, save_sharded_async
