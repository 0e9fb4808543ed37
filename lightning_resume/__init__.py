"""lightning-resume: a Lightning run that survives any stop and continues bit for bit.

The public API, nothing else. See README.md for what each part guarantees.
"""

from lightning_resume.activation.hook import (
    ActivationCheckpointingDDPStrategy,
    ActivationCheckpointingFSDPStrategy,
    ActivationCheckpointingStrategy,
)
from lightning_resume.activation.policy import BlockSelection, CheckpointPlan, plan_checkpointing
from lightning_resume.callback import ExactResume
from lightning_resume.errors import (
    CheckpointCorruptError,
    ConfigurationError,
    LightningResumeError,
    ResumeMismatchError,
    UnsafeCheckpointError,
)
from lightning_resume.io import (
    SafetensorsCheckpointIO,
    SkippedCheckpointWarning,
    UnencodableValueError,
    UnknownTypeError,
    newest_verified,
    register_converter,
)
from lightning_resume.preemption import PreemptionFlag
from lightning_resume.retention import CheckpointRecord, Decision, RetentionCheckpoint, RetentionPolicy
from lightning_resume.sharded import (
    AsyncShardedSaver,
    ShardedSaveError,
    ShardedSaveHandle,
    load_full,
    load_sharded,
    newest_committed,
    save_sharded,
    save_sharded_async,
    verify_sharded,
)
from lightning_resume.sharded.strategy import ShardedCheckpointIO, ShardedModelParallelStrategy
from lightning_resume.schedule import (
    Formula,
    ScheduleConfig,
    daly_interval,
    expected_waste,
    young_interval,
)
from lightning_resume.state.data import ResumableDataset, ResumableIterableDataset

__version__ = "0.1.0"

__all__ = [
    "ActivationCheckpointingDDPStrategy",
    "ActivationCheckpointingFSDPStrategy",
    "ActivationCheckpointingStrategy",
    "AsyncShardedSaver",
    "BlockSelection",
    "CheckpointCorruptError",
    "CheckpointPlan",
    "CheckpointRecord",
    "ConfigurationError",
    "Decision",
    "ExactResume",
    "Formula",
    "LightningResumeError",
    "PreemptionFlag",
    "ResumableDataset",
    "ResumableIterableDataset",
    "ResumeMismatchError",
    "SafetensorsCheckpointIO",
    "SkippedCheckpointWarning",
    "UnencodableValueError",
    "UnknownTypeError",
    "newest_verified",
    "register_converter",
    "save_sharded",
    "verify_sharded",
    "RetentionCheckpoint",
    "RetentionPolicy",
    "ScheduleConfig",
    "ShardedCheckpointIO",
    "ShardedModelParallelStrategy",
    "ShardedSaveError",
    "ShardedSaveHandle",
    "UnsafeCheckpointError",
    "daly_interval",
    "expected_waste",
    "load_full",
    "load_sharded",
    "save_sharded_async",
    "newest_committed",
    "plan_checkpointing",
    "young_interval",
]
