"""lightning-resume: a Lightning run that survives any stop and continues bit for bit."""

from lightning_resume.errors import (
    CheckpointCorruptError,
    ConfigurationError,
    LightningResumeError,
    ResumeMismatchError,
    UnsafeCheckpointError,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointCorruptError",
    "ConfigurationError",
    "LightningResumeError",
    "ResumeMismatchError",
    "UnsafeCheckpointError",
]
