"""Safe checkpoint files: pickle-free format, atomic commit, checksums, and the Lightning plugin."""

from lightning_resume.io.format import UnencodableValueError, UnknownTypeError, register_converter
from lightning_resume.io.last import SkippedCheckpointWarning, newest_verified
from lightning_resume.io.plugin import SafetensorsCheckpointIO
from lightning_resume.io.staging import AsyncWriteError, AsyncWriteWarning

__all__ = [
    "AsyncWriteError",
    "AsyncWriteWarning",
    "SafetensorsCheckpointIO",
    "SkippedCheckpointWarning",
    "UnencodableValueError",
    "UnknownTypeError",
    "newest_verified",
    "register_converter",
]
