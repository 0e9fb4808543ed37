"""The ``shm`` fixture: a fresh memory-tier directory under /dev/shm for one test, removed after it."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from lightning_resume.schedule.options import DEFAULT_MEMORY_DIR


@pytest.fixture
def shm() -> Iterator[Path]:
    root = Path(DEFAULT_MEMORY_DIR) / f"lightning-resume-test-{uuid.uuid4().hex[:8]}"
    yield root
    shutil.rmtree(root, ignore_errors=True)
