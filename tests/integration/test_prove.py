"""``lightning-resume prove`` on real scripts, as a user runs it: EXACT on the example and on a DDP x2 script
and a LightningCLI config; DIFFERS, at the right step and naming the cause, on scripts made to differ in each
way users meet (an unregistered ``torch.Generator``, a ``numpy.random.Generator`` on the model, a
``DataLoader`` subclass, a non-persistent buffer training changes, ``fit()`` without ``ckpt_path``); exit 2
with the output's tail for a script that crashes; the ``--json`` schema. Only 127.0.0.1 and local files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_resume.testing import assert_resumes_exactly
from tests.helpers.paths import REPO_ROOT
from tests.helpers.processes import child_env

TARGET = REPO_ROOT / "tests" / "helpers" / "jobs" / "prove_target.py"
EXAMPLE = REPO_ROOT / "examples" / "resume_proof.py"

# Outside `make test` (see tests/integration/conftest.py): the subset keeps the example (EXACT, with --json), a
# kill inside a validation, an RNG-stream defect, a relaunch that loaded no checkpoint, and the crash.
EXTENDED = frozenset(
    {
        "test_a_defect_is_found_at_the_right_step_and_named[loader_subclass]",
        "test_a_defect_is_found_at_the_right_step_and_named[numpy_generator]",
        "test_a_defect_is_found_at_the_right_step_and_named[buffer]",
        "test_ddp_two_ranks_prove_exact",
        "test_a_lightning_cli_config_proves_exact",
    }
)


def _prove(tmp_path: Path, *command: str, extra: tuple = (), timeout: float = 400) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "lightning_resume.cli.main", "prove", "--workdir", str(tmp_path / "work")]
    argv += ["--seed", "0", "--timeout", "180", *extra, "--", *command]
    return subprocess.run(argv, capture_output=True, text=True, env=child_env(), timeout=timeout, cwd=REPO_ROOT)


def test_the_example_proves_exact_and_says_so_in_json(tmp_path: Path) -> None:
    done = _prove(tmp_path, sys.executable, str(EXAMPLE), "--train", extra=("--json",))
    assert done.returncode == 0, done.stdout + done.stderr
    verdict = json.loads(done.stdout.strip().splitlines()[-1])
    assert verdict["verdict"] == "EXACT" and verdict["component"] is None
    assert set(verdict) >= {"step", "rank", "cause", "fix", "launches", "resumed_at", "compared", "workdir"}
    assert verdict["launches"]["0"] == 3 and len(verdict["resumed_at"]["0"]) == 2  # two kills, two relaunches
    assert verdict["compared"]["0"] > 30
    assert not list((tmp_path / "work").rglob("*.ckpt")), "checkpoints cleaned after an exact verdict"
    assert list((tmp_path / "work").rglob("trace-rank0.jsonl")), "traces and logs stay"


DEFECTS = {
    "torch_generator": ("loss", "not sure"),  # kept in a global: nothing recorded names it, and prove says so
    "numpy_generator": ("loss", "not sure"),
    "loader_subclass": ("rng", "position"),  # its new iterator drew its seed: the first symptom is the RNG
    "buffer": ("loss", "buffer"),
    "no_ckpt_path": ("start", "loaded no checkpoint"),
}


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_a_defect_is_found_at_the_right_step_and_named(tmp_path: Path, defect: str) -> None:
    component, cause = DEFECTS[defect]
    done = _prove(tmp_path, sys.executable, str(TARGET), "--defect", defect, extra=("--kills", "1", "--json"))
    assert done.returncode == 1, done.stdout + done.stderr
    verdict = json.loads(done.stdout.strip().splitlines()[-1])
    assert verdict["verdict"] == "DIFFERS" and verdict["component"] == component, verdict
    assert cause.lower() in (verdict["cause"] + verdict["fix"]).lower(), verdict
    if defect != "no_ckpt_path":  # the first step after the resume, not later
        assert verdict["step"] == verdict["resumed_at"]["0"][0], verdict


def test_a_kill_during_validation_resumes_exact(tmp_path: Path) -> None:
    """The second kill lands in a validation run (``prove`` kills every other launch at a validation's start)."""
    verdict = assert_resumes_exactly(
        [sys.executable, str(TARGET), "--validate_every", "4", "--max_steps", "30"], kills=2, seed=3, workdir=tmp_path
    )
    killed = (tmp_path / "B" / "trace" / "trace-rank0.jsonl").read_text().splitlines()
    starts = [i for i, line in enumerate(killed) if '"kind":"start"' in line.replace(" ", "")]
    assert len(starts) == 3 and '"val_start"' in killed[starts[2] - 1], "the second launch died in a validation"
    assert verdict.exact


def test_a_script_that_crashes_is_exit_2_with_its_output(tmp_path: Path) -> None:
    done = _prove(tmp_path, sys.executable, str(TARGET), "--crash_at", "0")
    assert done.returncode == 2
    assert "COULD NOT RUN" in done.stderr and "crashing on purpose" in done.stderr


def test_ddp_two_ranks_prove_exact(tmp_path: Path) -> None:
    assert_resumes_exactly(
        [sys.executable, str(TARGET), "--devices", "2", "--max_steps", "24"], kills=1, seed=0, workdir=tmp_path
    )


def test_a_lightning_cli_config_proves_exact(tmp_path: Path) -> None:
    config = tmp_path / "fit.yaml"
    config.write_text(
        "trainer:\n  max_steps: 24\n  accelerator: cpu\n  logger: false\n  enable_progress_bar: false\n"
        "  callbacks:\n    - class_path: lightning_resume.ExactResume\n      init_args: {mtbf: null}\n"
        "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
        "      init_args: {dirpath: ckpt, every_n_train_steps: 4, save_last: true}\n"
        "model:\n  defect: none\nseed_everything: 0\n"
    )
    cli = REPO_ROOT / "tests" / "helpers" / "jobs" / "prove_cli.py"
    assert_resumes_exactly(
        [sys.executable, str(cli), "fit", "--config", str(config)], kills=1, seed=0, workdir=tmp_path / "w",
        lightning_cli=True,
    )  # fmt: skip
