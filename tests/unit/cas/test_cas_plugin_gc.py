"""The plugin collects packs in a fit: after each checkpoint retention removes (sync and async saves), and at the
end of the fit (the packs of a save killed before its checkpoint). Every kept checkpoint verifies."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as lightning
import pytest

from lightning_resume import RetentionCheckpoint, RetentionPolicy, SafetensorsCheckpointIO
from lightning_resume.cas.refs import packs_of, read_refs
from lightning_resume.io.verify import verify
from tests.helpers.dedupe import FrozenFirst, write_pack
from tests.helpers.models import tiny_trainer

pytestmark = pytest.mark.timeout(300)


def _fit(directory: Path, save: str) -> SafetensorsCheckpointIO:
    lightning.seed_everything(0, verbose=False)
    io = SafetensorsCheckpointIO(dedupe=True, save=save)  # type: ignore[arg-type]
    keep = RetentionCheckpoint(dirpath=directory, every_n_train_steps=2, retention=RetentionPolicy(keep_last=2))
    trainer = tiny_trainer([keep], plugins=[io], max_steps=10, limit_train_batches=16)
    trainer.fit(FrozenFirst())
    return io


@pytest.mark.parametrize("save", ["sync", "async"])
def test_a_fit_keeps_only_the_packs_its_kept_checkpoints_reference(tmp_path: Path, save: str) -> None:
    _fit(tmp_path, save)
    kept = sorted(tmp_path.glob("*.ckpt"))
    assert len(kept) == 2
    referenced = set().union(*(packs_of(str(p)) for p in kept))
    assert {p.name for p in (tmp_path / "blocks").iterdir()} == {f"{name}.safetensors" for name in referenced}
    for path in kept:
        verify(str(path))


def test_the_end_of_a_fit_collects_a_killed_saves_pack_of_its_lineage_only(tmp_path: Path) -> None:
    io = _fit(tmp_path, "sync")
    lineage = read_refs(str(sorted(tmp_path.glob("*.ckpt"))[-1])).lineage
    orphan = write_pack(str(tmp_path), lineage, {"00" * 16: b"x" * 16})  # written, its checkpoint never committed
    other = write_pack(str(tmp_path), "b" * 32, {"11" * 16: b"y" * 16})  # another run's
    io.teardown()  # what the end of a fit runs
    names = {p.name for p in (tmp_path / "blocks").iterdir()}
    assert f"{orphan}.safetensors" not in names and f"{other}.safetensors" in names
