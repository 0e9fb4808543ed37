"""A resume the memory tier supplies reads the durable checkpoint's header only: ``ckpt_path="last"`` checks the
candidates' headers, and the full verification (and its warnings) comes only when the memory tier cannot supply
the resume. Shown with a durable checkpoint whose tensor bytes are damaged (its header intact): the memory tier
resumes without reading them; without the memory snapshot, "last" verifies in full and skips that file, as always.
Both of Lightning's formats: its own ``torch.save`` files and ours."""

from __future__ import annotations

import re
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Optional

import lightning
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_resume import ExactResume, MemoryTierOptions, SafetensorsCheckpointIO, ScheduleOptions
from lightning_resume.errors import SkippedCheckpointWarning
from lightning_resume.format.read import read_summary
from tests.helpers.callbacks import CrashAt
from tests.helpers.models import TinyData, TinyModel, tiny_trainer


def _fit(tmp_path: Path, shm: Path, safetensors: bool, crash_at: Optional[int] = None) -> ExactResume:
    """Durable checkpoints every 4 steps (4, 8), memory snapshots every 2 (10 is the newest at a crash at 11)."""
    lightning.seed_everything(0, verbose=False)
    exact = ExactResume(
        mtbf=None,
        schedule=ScheduleOptions(every_n_train_steps_max=100),
        memory_tier=MemoryTierOptions(dir=str(shm), every_n_train_steps_max=2),
    )
    callbacks = [exact, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_train_steps=4)]
    callbacks += [CrashAt(crash_at)] if crash_at is not None else []
    plugins = [SafetensorsCheckpointIO()] if safetensors else []
    trainer = tiny_trainer(callbacks, max_steps=12, limit_train_batches=4, plugins=plugins)
    trainer.fit(TinyModel(), datamodule=TinyData(), ckpt_path="last")
    return exact


def _damage_tensor_bytes(path: Path) -> None:
    """Flip a byte of the tensor data and leave the header (run id, step) intact."""
    data = bytearray(path.read_bytes())
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            info = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size > 0)
        local = info.header_offset  # the local header's own name and extra lengths (torch pads the extra field)
        start = local + 30 + int.from_bytes(data[local + 26 : local + 28], "little")
        start += int.from_bytes(data[local + 28 : local + 30], "little")
        data[start] ^= 0xFF  # a tensor record: its CRC-32 fails, the pickle still reads
    else:
        data[-3] ^= 0xFF  # the data section: a tensor checksum fails, the header's digests hold
        read_summary(str(path))  # still a good header
    path.write_bytes(bytes(data))


def _crashed_with_damaged_newest(tmp_path: Path, shm: Path, safetensors: bool) -> Path:
    with pytest.raises(RuntimeError, match="crash"):
        _fit(tmp_path, shm, safetensors, crash_at=11)
    newest = max((tmp_path / "ckpt").iterdir(), key=lambda p: int(p.stem.split("step=")[1].split("-")[0]))
    assert "step=8" in newest.name
    _damage_tensor_bytes(newest)
    return newest


@pytest.mark.parametrize("safetensors", [False, True], ids=["torch.save", "safetensors"])
def test_a_memory_tier_resume_does_not_read_the_durable_checkpoint(tmp_path: Path, shm: Path, safetensors) -> None:
    """Before, "last" verified the newest durable file in full before the memory tier was asked (with Lightning's
    own ``torch.save`` files): it read every byte, found the damage and skipped to step 4."""
    _crashed_with_damaged_newest(tmp_path, shm, safetensors)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SkippedCheckpointWarning)  # no durable file was verified: none skipped
        resumed = _fit(tmp_path, shm, safetensors)
    assert resumed.resume_report.tier == "memory" and resumed.resume_report.step == 10
    assert resumed.resume_report.memory_sources == (0,)
    assert resumed.resume_report.exact and resumed.resume_report.fingerprint_ok


@pytest.mark.parametrize("safetensors", [False, True], ids=["torch.save", "safetensors"])
def test_without_the_memory_snapshot_last_is_verified_in_full(tmp_path: Path, shm: Path, safetensors) -> None:
    """The node is gone with its memory: "last" is resolved as without the memory tier, the damaged step-8 file
    passed over naming it (skipped, or with our format refused as its load hashes it), and the run resumes from
    step 4."""
    newest = _crashed_with_damaged_newest(tmp_path, shm, safetensors)
    shutil.rmtree(shm)
    with pytest.warns(SkippedCheckpointWarning, match=re.escape(str(newest))):  # safetensors: hashed as it loads
        resumed = _fit(tmp_path, shm, safetensors)
    assert resumed.resume_report.tier == "durable" and resumed.resume_report.step == 4
    assert "step=4" in str(resumed.resume_report.source) and resumed.resume_report.memory_sources is None


def test_a_superseded_snapshot_is_proven_ours_from_its_header(tmp_path: Path) -> None:
    """The previous snapshot goes once the new one is durable, if it records being that snapshot: the record is
    read from the header (remotely a ranged read; before, the whole file was fetched, so a relaunch from memory
    read the durable checkpoint in full at its first durable save: tests/integration/test_memory_tier_replicas.py
    counts those bytes), for both formats; a file naming another snapshot, or none, is not ours."""
    import torch

    from lightning_resume.exact.snapshots import SNAPSHOT_KEY, written_as_snapshot
    from lightning_resume.format.write import save_file

    name = "last-snapshot-step=000000006.ckpt"
    state = {"global_step": 6, "w": torch.ones(4), SNAPSHOT_KEY: {"name": name}}
    ours, theirs, torch_file = tmp_path / "a" / name, tmp_path / name, tmp_path / "t" / name
    for path in (ours, torch_file):
        path.parent.mkdir()
    save_file(state, str(ours))
    save_file({**state, SNAPSHOT_KEY: {"name": "other"}}, str(theirs))
    torch.save(state, torch_file)
    _damage_tensor_bytes(ours)  # its tensors are not read: the record in the header decides
    assert written_as_snapshot(str(ours)) and written_as_snapshot(str(torch_file))
    assert not written_as_snapshot(str(theirs)) and not written_as_snapshot(str(tmp_path / "missing.ckpt"))
