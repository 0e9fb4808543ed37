"""newest_verified: newest candidate that verifies wins; each skipped file is named in a warning."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_resume import SafetensorsCheckpointIO, SkippedCheckpointWarning, newest_verified
from lightning_resume.format.read import load_file
from lightning_resume.io.resolve import is_last_name, siblings


def _write(io, path, step, mtime):
    io.save_checkpoint({"global_step": step, "state_dict": {"w": torch.full((3,), float(step))}}, str(path))
    os.utime(path, (mtime, mtime))


def test_newest_verified_skips_corrupt_and_partial_files(tmp_path):
    io = SafetensorsCheckpointIO()
    for step in (1, 2, 3):
        _write(io, tmp_path / f"step={step}.ckpt", step, 1000 + step)
    os.truncate(tmp_path / "step=3.ckpt", 100)  # partial newest
    os.utime(tmp_path / "step=3.ckpt", (1003, 1003))
    (tmp_path / "step=4.ckpt").write_bytes(b"garbage")
    os.utime(tmp_path / "step=4.ckpt", (2000, 2000))
    paths = [str(p) for p in tmp_path.iterdir()]
    with pytest.warns(SkippedCheckpointWarning) as record:
        chosen = newest_verified(paths, io.verify_checkpoint)
    assert chosen == str(tmp_path / "step=2.ckpt")
    skipped = [str(w.message) for w in record]
    assert len(skipped) == 2 and "step=4.ckpt" in skipped[0] and "step=3.ckpt" in skipped[1]


def test_newest_verified_none_and_missing(tmp_path):
    assert newest_verified([str(tmp_path / "nope.ckpt")], SafetensorsCheckpointIO().verify_checkpoint) is None


def test_last_names_and_siblings(tmp_path):
    assert is_last_name("/a/last.ckpt") and is_last_name("last-v3.ckpt") and not is_last_name("epoch=1.ckpt")
    for name in ("last.ckpt", "a.ckpt", "b.safetensors", ".last.ckpt.tmp-1-0123abcd", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    assert sorted(os.path.basename(p) for p in siblings(str(tmp_path / "last.ckpt"))) == [
        "a.ckpt",
        "b.safetensors",
    ]


def test_mmap_option_loads_the_same_values(tmp_path):
    io = SafetensorsCheckpointIO(mmap=True)
    _write(io, tmp_path / "m.ckpt", 5, 1000)
    assert torch.equal(io.load_checkpoint(str(tmp_path / "m.ckpt"))["state_dict"]["w"], torch.full((3,), 5.0))
    assert torch.equal(load_file(str(tmp_path / "m.ckpt")).checkpoint["state_dict"]["w"], torch.full((3,), 5.0))
