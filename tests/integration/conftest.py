"""Every test collected under tests/integration spawns processes: mark it ``multiprocess``.

Deselect them with ``pytest -m "not multiprocess"``. Conftest hooks see the items of the whole
session, so only items that live in this directory are marked.

The kill-and-resume matrices are large (each case is three or more fresh processes). ``make test`` (CI)
runs a covering subset: every mechanism and every configuration axis at least once; ``make test-all`` runs
the whole cross product. A module lists the cases outside the subset in ``EXTENDED``, by test name
(``test_x``, every case) or by test id (``test_x[case]``); they get the ``extended`` marker. A name that
matches no collected test is an error, so the list cannot silently go stale.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seen: dict[object, set[str]] = defaultdict(set)
    for item in items:
        if HERE not in Path(item.path).resolve().parents:
            continue
        item.add_marker(pytest.mark.multiprocess)
        module = getattr(item, "module", None)
        extended = getattr(module, "EXTENDED", frozenset())
        names = {item.name, getattr(item, "originalname", item.name)}
        seen[module] |= names
        if names & extended:
            item.add_marker(pytest.mark.extended)
    if any("::" in arg for arg in config.args):
        return  # a node id on the command line collects part of a module: nothing to judge the lists by
    for module, names in seen.items():
        stale = set(getattr(module, "EXTENDED", frozenset())) - names
        if stale:
            module_name = getattr(module, "__name__", module)
            raise pytest.UsageError(f"{module_name}.EXTENDED names no collected test: {sorted(stale)}")
