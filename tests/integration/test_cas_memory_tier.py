"""Content-addressed durable saves (``SafetensorsCheckpointIO(dedupe=True)``) under ``ExactResume``'s memory tier,
killed for real and resumed in a fresh process, bit for bit.

The fine-tune with a frozen backbone (``jobs/dedupe_job.py``) takes a memory snapshot every 2 steps and a durable,
deduped one every 6; killed at step 9 (disk: step 6, memory: step 8). Resumed with the memory snapshot there, it
continues from step 8 and "last" read only the headers of the durable files (their packs' data was damaged and
nothing noticed); with the snapshot gone (a node loss), from the durable dedupe checkpoint at step 6. The memory
snapshots themselves are whole files (never deduped), the durable saves reference the frozen weight.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from lightning_resume.cas.refs import read_refs
from lightning_resume.format.read import load_file
from lightning_resume.memory import store as memory_tier
from tests.helpers import kill_resume as h

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

EXTENDED = frozenset(
    {"test_dedupe_durable_saves_resume_from_memory_reading_headers_only_or_from_disk_exactly[overlapped]"}
)
"""In make test-all only: the durable dedupe saves written in the background, their copy overlapped with the next
step (``save="overlapped"``), beside the memory tier's snapshots."""

DURABLE_EVERY, MEMORY_EVERY, KILL_AT = 6, 2, 9
FROZEN = "state_dict.net.0.weight"


SAVES = {"sync": {}, "overlapped": {"async": True, "overlap_copy": True}}


def _cfg(tmp_path: Path, shm: Path, save: str) -> dict[str, Any]:
    memory = {"dir": str(shm), "every_n_train_steps_max": MEMORY_EVERY}
    exact = {"schedule": {"every_n_train_steps_max": DURABLE_EVERY}, "memory_tier": memory}
    return {
        "job": "dedupe_job.py", "safetensors": True, "io_args": {"dedupe": True}, "max_epochs": 2,
        "ckpt": {"save_top_k": 0}, "exact_args": exact, "ckpt_dir": str(tmp_path / "B" / "ckpt"),
        "flush_memory_tier": True, **SAVES[save],
    }  # fmt: skip


def _snapshots(shm: Path) -> list[Path]:
    return sorted(shm.glob("*/*/rank-*.safetensors"))


def _restore(tmp_path: Path, cfg: dict, backup: Path, shm: Path, name: str) -> dict:
    """B's state as it was at the kill (a previous resume consumed it)."""
    shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(cfg["ckpt_dir"], ignore_errors=True)
    shutil.copytree(backup / "shm", shm)
    shutil.copytree(backup / "ckpt", cfg["ckpt_dir"])
    return dict(cfg, out=str(tmp_path / name), resume="last")


def _damage_every_pack(ckpt_dir: str) -> None:
    """Flip one byte of block data near the end of each pack: a full read of any durable file would fail."""
    packs = sorted((Path(ckpt_dir) / "blocks").glob("*.safetensors"))
    assert packs
    for pack in packs:
        data = bytearray(pack.read_bytes())
        data[-5] ^= 0x01
        pack.write_bytes(bytes(data))


@pytest.mark.parametrize("save", list(SAVES))
def test_dedupe_durable_saves_resume_from_memory_reading_headers_only_or_from_disk_exactly(tmp_path, shm, save):
    cfg = _cfg(tmp_path, shm, save)
    h.uninterrupted(cfg, tmp_path)
    h.run_until_paused(dict(cfg, out=str(tmp_path / "B"), pause_before=KILL_AT), tmp_path)
    (snapshot,) = _snapshots(shm)
    assert int(load_file(str(snapshot)).checkpoint[memory_tier.MEMORY_KEY]["step"]) == 8
    assert not read_refs(str(snapshot)).tensors, "a memory snapshot is one whole file, never deduped"
    durable = sorted(Path(cfg["ckpt_dir"]).glob("*.ckpt"))
    assert durable and all(FROZEN in read_refs(str(p)).tensors for p in durable), durable
    backup = tmp_path / "backup"
    shutil.copytree(shm, backup / "shm")
    shutil.copytree(cfg["ckpt_dir"], backup / "ckpt")

    c = _restore(tmp_path, cfg, backup, shm, "C_memory")
    _damage_every_pack(cfg["ckpt_dir"])  # "last" asked the memory tier first: it reads no block of any pack
    h.run(c, tmp_path)
    h.assert_exact_resume(tmp_path / "A", Path(c["out"]), resumed_after=8)
    out = h.output(c)
    assert "resuming from the memory tier at step 8" in out
    assert "SkippedCheckpointWarning" not in out and "checksum mismatch" not in out, out[-3000:]
    # the resumed run continued the killed run's lineage: its saves reference the frozen weight where it was
    before = read_refs(str(backup / "ckpt" / durable[-1].name))
    after = [
        read_refs(str(p))
        for p in sorted(Path(cfg["ckpt_dir"]).glob("*.ckpt"))
        if p.name not in {d.name for d in durable}
    ]
    assert after and all(r.lineage == before.lineage for r in after), (before.lineage, [r.lineage for r in after])
    assert all(r.tensors[FROZEN].pack == before.tensors[FROZEN].pack for r in after)

    c = _restore(tmp_path, cfg, backup, shm, "C_node_lost")
    shutil.rmtree(shm)  # the machine is gone, and its shared memory with it
    h.run(c, tmp_path)
    h.assert_exact_resume(tmp_path / "A", Path(c["out"]), resumed_after=DURABLE_EVERY)
    assert all(FROZEN in read_refs(str(p)).tensors for p in Path(cfg["ckpt_dir"]).glob("*.ckpt"))
