"""Every script in ``benchmarks/`` imports against the package as it is now: a renamed constant once broke
``bench_memory_tier.py`` with nothing in the suite to notice. One fresh interpreter imports them all (each
module's top level only; ``main`` runs under ``__name__ == "__main__"``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_IMPORT_ALL = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module('benchmarks.' + name)\n"


def test_every_benchmark_script_imports() -> None:
    names = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__")
    assert "bench_memory_tier" in names and len(names) >= 10
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, *names], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
