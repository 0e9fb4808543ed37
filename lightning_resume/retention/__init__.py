"""Retention: which checkpoint files to keep (``policy``), their names and checks (``files``), and the
``ModelCheckpoint`` subclass that applies them (``checkpoint``)."""

from lightning_resume.retention.checkpoint import RetentionCheckpoint
from lightning_resume.retention.policy import CheckpointRecord, Decision, RetentionPolicy

__all__ = ["CheckpointRecord", "Decision", "RetentionCheckpoint", "RetentionPolicy"]
