"""lightning-resume: a Lightning run that survives any stop and continues bit for bit."""

from lightning_resume.callback import ExactResume
from lightning_resume.errors import (
    CheckpointCorruptError,
    ConfigurationError,
    LightningResumeError,
    ResumeMismatchError,
    UnsafeCheckpointError,
)

from lightning_resume.state.data import ResumableDataset, ResumableIterableDataset

__version__ = "0.1.0"

__all__ = [
    "ExactResume",
    "ResumableDataset",
    "ResumableIterableDataset",
    "CheckpointCorruptError",
    "ConfigurationError",
    "LightningResumeError",
    "ResumeMismatchError",
    "UnsafeCheckpointError",
]
