"""Content-addressed saves (``SafetensorsCheckpointIO(dedupe=True)``) killed for real and resumed bit for bit.

A fine-tune with a frozen backbone (``jobs/dedupe_job.py``) saves every 2 steps; run B is SIGKILLed mid-epoch,
run C resumes its "last" in a fresh process and must continue the uninterrupted run A bit for bit, while every
save after the first wrote a pack smaller than the state and referenced the frozen weight from the first pack
instead of writing it again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_resume.cas import layout
from lightning_resume.cas.refs import read_pack_header, read_refs
from tests.helpers import kill_resume as h

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

FROZEN = "state_dict.net.0.weight"
HEAD = "state_dict.net.2.weight"
DEDUPE = {
    "job": "dedupe_job.py",
    "safetensors": True,
    "io_args": {"dedupe": True},
    "ckpt": {"every_n_train_steps": 2, "save_top_k": -1},
    "max_epochs": 2,
}


def assert_frozen_weight_referenced_not_rewritten(ckpt_dir: str) -> None:
    saves = sorted(Path(ckpt_dir).glob("epoch=*.ckpt"), key=lambda p: int(p.stem.split("step=")[1]))
    assert len(saves) >= 3, saves
    first = read_refs(str(saves[0]))
    assert first.tensors[FROZEN].pack == first.wrote  # the first save wrote the frozen weight once
    for later in saves[1:]:
        refs = read_refs(str(later))
        assert refs.lineage == first.lineage
        assert refs.tensors[FROZEN].key == first.tensors[FROZEN].key
        assert refs.tensors[FROZEN].pack != refs.wrote, f"{later.name} wrote the frozen weight again"
        assert refs.tensors[HEAD].pack == refs.wrote  # the head changed: written into this save's pack
        pack = read_pack_header(layout.pack_path(str(later), refs.wrote))
        state = sum(r.nbytes for r in refs.tensors.values())
        assert FROZEN not in pack.keys and refs.tensors[FROZEN].key not in pack.keys
        assert sum(pack.keys.values()) <= state - refs.tensors[FROZEN].nbytes, (later.name, pack.keys)


def test_dedupe_kill_and_resume_is_bitwise_and_later_saves_write_only_what_changed(tmp_path):
    a, c = h.three_runs(DEDUPE, tmp_path, pause=13)
    h.assert_exact_resume(a["out"], c["out"], resumed_after=12)
    assert_frozen_weight_referenced_not_rewritten(a["ckpt_dir"])
    assert_frozen_weight_referenced_not_rewritten(c["ckpt_dir"])  # B's saves, then C's, one lineage
