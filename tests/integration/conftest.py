"""Every test collected under tests/integration spawns processes: mark it ``multiprocess``.

Deselect them with ``pytest -m "not multiprocess"``. Conftest hooks see the items of the whole
session, so only items that live in this directory are marked.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.multiprocess)
