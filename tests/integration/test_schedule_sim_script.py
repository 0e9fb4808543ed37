"""benchmarks/interval_sim.py run as a program: it prints a markdown table of intervals and waste."""

import subprocess
import sys

from tests.helpers.paths import REPO_ROOT


def _simulate(*args: str) -> tuple[list[str], str]:
    """Run the simulation with ``args``: its table's lines (stdout) and its stderr."""
    proc = subprocess.run(
        [sys.executable, "benchmarks/interval_sim.py", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines(), proc.stderr


def test_simulation_script_runs_and_prints_a_markdown_table():
    lines, stderr = _simulate("--seeds", "20", "--work-mtbfs", "10", "--mtbf", "15min", "--c", "30s")
    assert lines[0].startswith("| M | C | T* Young") and len(lines) == 3 and lines[2].startswith("| 15 min | 30 s |")
    assert "measured blocking cost" in stderr


def test_two_level_simulation_script_prints_its_table():
    lines, _ = _simulate("--two-level", "--seeds", "20", "--work-mtbfs", "10")
    assert lines[0].startswith("| M1 | M2 | C1 | C2 | two-level T1, k (T2)") and len(lines) == 3
    assert lines[2].startswith("| 60 min | 24 h | 0.2 s | 10 s |")
    ratio = float(lines[2].split("|")[-3].strip().rstrip("x"))  # single-level Young waste / two-level waste
    assert ratio > 2.0


def test_three_level_simulation_script_prints_its_table():
    lines, stderr = _simulate("--three-level", "--mix", "llama3", "--seeds", "20", "--work-mtbfs", "10")
    assert lines[0].startswith("| failure mix | M1 / M2 / M3 (job) | C1 / D2 (C2) / C3 | three-level T1, k (T3)")
    assert len(lines) == 3 and lines[2].startswith(
        "| llama3 | 20.6 h / 3.64 h / 1.3e+03 h | 1 s / 10 s (0.3 s) / 60 s |"
    )
    ratio = float(lines[2].split("|")[-4].strip().rstrip("x"))  # two-level waste / three-level waste
    assert ratio > 1.5 and "C2 = 3% of D2" in stderr
