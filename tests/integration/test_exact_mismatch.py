"""Mismatches get words, not silence: a checkpoint that does not fit the run is refused (or, with
strict=False, resumed approximately with a warning listing what differs); a plain Lightning
checkpoint resumes with a warning naming what is not restored."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import kill_resume as h
from tests.helpers import processes
from tests.helpers.paths import REPO_ROOT

# Outside `make test` (see tests/integration/conftest.py): `make demo` runs the demo itself.
EXTENDED = frozenset({"test_demo_proves_its_claims"})

BASE = {
    "n": 40,
    "batch_size": 4,
    "max_epochs": 1,
    "dropout": 0.2,
    "shuffle": True,
    "ckpt": {"every_n_train_steps": 3, "save_top_k": -1, "save_last": True, "filename": "{step}"},
}


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("killed")
    h.run_until_paused(dict(BASE, out=str(root / "B"), ckpt_dir=str(root / "ckpt"), pause_before=4), root)
    return root


def _resume(killed: Path, tmp_path: Path, **changes) -> tuple[int, str]:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(killed / "ckpt", ckpt)
    cfg = dict(BASE, out=str(tmp_path / "C"), ckpt_dir=str(ckpt), resume="last", **changes)
    return h.exit_code(cfg, tmp_path), h.output(cfg)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"num_workers": 2}, "num_workers: checkpoint 0, now 2"),
        ({"batch_size": 5}, "batch_size: checkpoint 4, now 5"),
        ({"n": 44}, "dataset_length: checkpoint 40, now 44"),
    ],
)
def test_mismatch_is_refused_with_what_differs(killed: Path, tmp_path: Path, change: dict, named: str) -> None:
    rc, out = _resume(killed, tmp_path, **change)
    assert rc != 0
    assert "ResumeMismatchError" in out and named in out and "strict=False" in out


def test_strict_false_continues_and_lists_differences(killed: Path, tmp_path: Path) -> None:
    rc, out = _resume(killed, tmp_path, batch_size=5, strict=False)
    assert rc == 0, out
    assert "resuming approximately" in out and "batch_size: checkpoint 4, now 5" in out


def test_plain_lightning_checkpoint_resumes_with_a_warning(tmp_path: Path) -> None:
    b = dict(BASE, out=str(tmp_path / "B"), ckpt_dir=str(tmp_path / "ckpt"), pause_before=4, exact=False)
    h.run_until_paused(b, tmp_path)
    c = dict(BASE, out=str(tmp_path / "C"), ckpt_dir=str(tmp_path / "ckpt"), resume="last")
    h.run(c, tmp_path)
    out = h.output(c)
    assert "written without ExactResume" in out and "RNG streams" in out
    assert out.count("written without ExactResume") == 1


@pytest.mark.slow
def test_demo_proves_its_claims() -> None:
    out = processes.run([REPO_ROOT / "examples" / "resume_proof.py"], timeout=300)
    assert "ExactResume : 20/20 steps after the resume identical" in out
    assert "weights only: 0/20 steps identical" in out
    assert "PROOF HOLDS" in out


def test_fingerprint_catches_state_that_was_not_restored_as_saved(killed: Path, tmp_path: Path) -> None:
    """A checkpoint whose weights were changed after the fingerprint was taken is refused."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(killed / "ckpt", ckpt)
    state = torch.load(ckpt / "last.ckpt", weights_only=True)
    name = next(iter(state["state_dict"]))
    state["state_dict"][name] = state["state_dict"][name] + 1e-3
    torch.save(state, ckpt / "last.ckpt")
    cfg = dict(BASE, out=str(tmp_path / "C"), ckpt_dir=str(ckpt), resume="last")
    assert h.exit_code(cfg, tmp_path) != 0
    out = h.output(cfg)
    assert (
        "fingerprint after restore: weights" in out
        and "optimizer" not in out.split("fingerprint after restore")[1][:200]
    )
