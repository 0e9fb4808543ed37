"""Content-addressed saves (``SafetensorsCheckpointIO(dedupe=True)``) killed for real and resumed bit for bit.

A fine-tune with a frozen backbone (``jobs/dedupe_job.py``) saves every 2 steps; run B is SIGKILLed mid-epoch,
run C resumes its "last" in a fresh process and must continue the uninterrupted run A bit for bit, while every
save after the first wrote a pack smaller than the state and referenced the frozen weight from the first pack
instead of writing it again.
"""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest

from lightning_resume.cas import layout
from lightning_resume.cas.refs import read_pack_header, read_refs
from tests.helpers import kill_resume as h
from tests.helpers.s3 import s3_env

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


def test_sigkill_between_the_pack_and_the_checkpoint_file_resumes_from_the_previous_checkpoint(tmp_path):
    a = h.uninterrupted(DEDUPE, tmp_path)
    b = dict(DEDUPE, out=str(tmp_path / "B"), ckpt_dir=str(tmp_path / "B" / "ckpt"), pause_in_save=4)
    h.run_until_paused(b, tmp_path)  # killed in the 4th save (step 8): its pack is committed, its file is not
    saved = sorted(p.name for p in Path(b["ckpt_dir"]).glob("*.ckpt"))
    assert saved == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt"], saved
    referenced = {r.pack for p in Path(b["ckpt_dir"]).glob("*.ckpt") for r in read_refs(str(p)).tensors.values()}
    packs = {p.name[: -len(".safetensors")] for p in (Path(b["ckpt_dir"]) / "blocks").glob("*.safetensors")}
    assert len(packs - referenced) == 1, (packs, referenced)  # the killed save's pack, referenced by no file
    c = h.resumed(DEDUPE, tmp_path, b["ckpt_dir"])
    h.assert_exact_resume(a["out"], c["out"], resumed_after=6)
    assert_frozen_weight_referenced_not_rewritten(c["ckpt_dir"])


@pytest.mark.extended  # ~40 s; make test covers async dedupe saves (unit) and remote ones on mem:// (unit)
def test_dedupe_async_saves_on_s3_killed_and_resumed_bit_for_bit(tmp_path, s3_bucket, s3_server):
    cfg = dict(DEDUPE, **{"async": True})
    a = h.uninterrupted(cfg, tmp_path)
    remote_dir, env = f"{s3_bucket}/dedupe", s3_env(s3_server.endpoint)
    b = dict(cfg, out=str(tmp_path / "B"), ckpt_dir=remote_dir, pause_before=13, env=env)
    h.run_until_paused(b, tmp_path)
    c = h.resumed(cfg, tmp_path, remote_dir, env=env)
    h.assert_exact_resume(a["out"], c["out"], resumed_after=12)
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(remote_dir[len("s3://") :]))
    saves = sorted((n for n in names if n.startswith("epoch=")), key=lambda n: int(n[:-5].split("step=")[1]))
    saves = [f"{remote_dir}/{n}" for n in saves]
    refs = [read_refs(p) for p in saves]
    assert "blocks" in names and len({r.lineage for r in refs}) == 1
    frozen = {r.tensors[FROZEN].pack for r in refs}
    assert frozen == {refs[0].wrote}, frozen  # written once on S3, referenced by every later save
    assert not (tmp_path / "s3:").exists()
