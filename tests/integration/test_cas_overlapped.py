"""Content-addressed saves with overlapped snapshot copies (``SafetensorsCheckpointIO(dedupe=True,
save="overlapped")``) under a real kill: run A uninterrupted, B SIGKILLed, C resumed in a fresh process; C
continues A bit for bit, every save compared.

A dedupe save's write (hashing what is predicted unchanged, the pack, then the checkpoint file) runs on the worker
only once the overlapped copy reached its barrier, so it reads the snapshot as it was at the save. The deferred
copy is held back on its helper thread (``slow_copy``); in the ``edit_weights`` case every weight, the frozen one
too, is edited in place between each save and the next optimizer step, so the copy-on-write guard must keep each
as it was at the save, and a frozen weight that changes is written again, never referenced stale.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_resume.cas.refs import read_refs
from tests.helpers import kill_resume as h

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

FROZEN = "state_dict.net.0.weight"
BASE = {
    "job": "dedupe_job.py", "safetensors": True, "io_args": {"dedupe": True}, "async": True, "overlap_copy": True,
    "slow_copy": 0.05, "ckpt": {"every_n_train_steps": 2, "save_top_k": -1}, "max_epochs": 2,
}  # fmt: skip
CASES = {"frozen": {}, "edit_weights": {"edit_weights": True}}


def _frozen_keys(ckpt_dir: str) -> list[tuple[str, bool]]:
    """Per save, oldest first: the frozen weight's key, and whether that save wrote it (into its own pack)."""
    saves = sorted(Path(ckpt_dir).glob("epoch=*.ckpt"), key=lambda p: int(p.stem.split("step=")[1]))
    refs = [read_refs(str(p)) for p in saves]
    return [(r.tensors[FROZEN].key, r.tensors[FROZEN].pack == r.wrote) for r in refs]


@pytest.mark.parametrize("case", list(CASES))
def test_dedupe_overlapped_saves_resume_bit_for_bit(tmp_path: Path, case: str) -> None:
    a, c = h.three_runs({**BASE, **CASES[case]}, tmp_path, pause=13)
    h.assert_exact_resume(a["out"], c["out"], resumed_after=12, compare_saves=True)
    for run in (a, c):
        frozen = _frozen_keys(run["ckpt_dir"])
        assert len(frozen) >= 3, frozen
        if case == "frozen":  # written by the first save only, referenced by every later one
            assert len({key for key, _ in frozen}) == 1 and [w for _, w in frozen] == [True] + [False] * (
                len(frozen) - 1
            ), frozen
        else:  # edited at every step: a new key each save, each written by its save
            assert len({key for key, _ in frozen}) == len(frozen) and all(w for _, w in frozen), frozen
            stats = json.loads((Path(run["out"]) / "report-rank0.json").read_text())["overlap_copy"]
            assert stats["guarded"] > 0, f"the guard copied nothing: the edits never met a copy in flight ({stats})"
