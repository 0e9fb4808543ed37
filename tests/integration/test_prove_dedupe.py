"""``lightning-resume prove`` on a script whose Trainer saves with ``SafetensorsCheckpointIO(dedupe=True)`` and
fine-tunes a frozen backbone (``jobs/prove_target.py --dedupe``): EXACT, with the killed run's saves
referencing the frozen weight from a pack instead of writing it again. Only local files."""

from __future__ import annotations

import sys
from pathlib import Path

from lightning_resume.cas.refs import read_refs
from lightning_resume.testing import assert_resumes_exactly
from tests.helpers.paths import REPO_ROOT

# Outside `make test` (~31 s): every dedupe kill-and-resume test already ends with prove's comparison of its runs
# (``kill_resume.assert_exact_resume``); this one runs the CLI's own launches and kills on a user's script.
EXTENDED = frozenset({"test_prove_says_exact_on_a_script_with_dedupe_saves_and_a_frozen_part"})

TARGET = REPO_ROOT / "tests" / "helpers" / "jobs" / "prove_target.py"
FROZEN = "state_dict.backbone.weight"


def test_prove_says_exact_on_a_script_with_dedupe_saves_and_a_frozen_part(tmp_path: Path) -> None:
    verdict = assert_resumes_exactly(
        [sys.executable, str(TARGET), "--dedupe", "--max_steps", "16"], kills=1, seed=0, workdir=tmp_path, keep=True
    )
    assert verdict.exact
    saves = sorted((tmp_path / "B").rglob("*.ckpt"))  # ModelCheckpoint's and ExactResume's
    assert len(saves) >= 2, saves
    refs = [read_refs(str(p)) for p in saves]
    assert all(FROZEN in r.tensors for r in refs), "the frozen weight is referenced, not inline"
    assert len({r.tensors[FROZEN].key for r in refs}) == 1
    assert any(r.tensors[FROZEN].pack != r.wrote for r in refs), "a later save wrote the frozen weight again"
