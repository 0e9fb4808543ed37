"""A pytest plugin that writes every warning a test raised to a JSON-lines file, in both runs.

Owns observation only (loaded with ``-p record`` by ``run.py`` in the stock and the injected run
alike, so the two differ by the injection alone): it changes no filter and no outcome. Lightning's
pytest options hide the warnings summary, but ``pytest_warning_recorded`` still sees each one.
Under xdist the controller receives the workers' warnings, so only the controller writes.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest

ENV = "LSUITE_WARNINGS_FILE"


def pytest_warning_recorded(warning_message: warnings.WarningMessage, when: str, nodeid: str, location: object) -> None:
    path = os.environ.get(ENV)
    config = _CONFIG[0]
    if not path or config is None or hasattr(config, "workerinput"):
        return
    text = str(warning_message.message).strip().splitlines()
    record = {
        "nodeid": nodeid,
        "when": when,
        "category": warning_message.category.__name__,
        "message": (text[0] if text else "")[:240],
        "filename": warning_message.filename,
    }
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


_CONFIG: list[pytest.Config | None] = [None]


def pytest_configure(config: pytest.Config) -> None:
    _CONFIG[0] = config
