"""benchmarks/interval_sim.py run as a program: it prints a markdown table of intervals and waste."""

import subprocess
import sys

from tests.helpers.paths import REPO_ROOT

ROOT = str(REPO_ROOT)


def test_simulation_script_runs_and_prints_a_markdown_table():
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/interval_sim.py",
            "--seeds",
            "20",
            "--work-mtbfs",
            "10",
            "--mtbf",
            "15min",
            "--c",
            "30s",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("| M | C | T* Young") and len(lines) == 3 and lines[2].startswith("| 15 min | 30 s |")
    assert "measured blocking cost" in proc.stderr
