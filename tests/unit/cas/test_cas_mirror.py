"""The mirror with dedupe checkpoints: it uploads the packs it lacks before the checkpoint file, never twice, and
collects its packs when it deletes a checkpoint. To a local directory and to S3 (moto on 127.0.0.1)."""

from __future__ import annotations

import lightning.pytorch as lightning
import pytest

from lightning_resume import Mirror, RetentionCheckpoint, RetentionPolicy, SafetensorsCheckpointIO
from lightning_resume.cas.layout import BLOCKS
from lightning_resume.cas.refs import packs_of
from lightning_resume.io.verify import verify
from lightning_resume.retention import mirror as mirror_module
from lightning_resume.retention.mirror import MirrorUploader
from lightning_resume.storage import files as storage
from tests.helpers.dedupe import FrozenFirst, state, write_checkpoint
from tests.helpers.models import tiny_trainer

pytestmark = pytest.mark.timeout(120)

A = "a" * 32


@pytest.fixture(params=["local", "s3"])
def target(request, tmp_path) -> str:
    return str(tmp_path / "mirror") if request.param == "local" else f"{request.getfixturevalue('s3_bucket')}/run"


def _mirror_packs(target: str) -> set:
    return {e.name for e in storage.list_dir(storage.join(target, BLOCKS))}


def test_the_mirror_gets_the_packs_first_then_the_file_and_collects_its_packs(tmp_path, target, monkeypatch) -> None:
    local, held = tmp_path / "local", {}
    packs = {s: write_checkpoint(str(local / f"step={s}.ckpt"), state(s), A, held=held)[0] for s in (1, 2, 3)}
    copied: list = []
    copy = mirror_module.copy_file
    monkeypatch.setattr(mirror_module, "copy_file", lambda s, t: (copied.append(storage.basename(t)), copy(s, t)))
    mirror = MirrorUploader(target)
    for step in (1, 2, 3):
        mirror.upload(str(local / f"step={step}.ckpt"))
    assert mirror.wait(timeout=120) and all(o.error is None for o in mirror.settle())
    pack_files = [f"{packs[s]}.safetensors" for s in (1, 2, 3)]
    assert copied == [pack_files[0], "step=1.ckpt", pack_files[1], "step=2.ckpt", pack_files[2], "step=3.ckpt"]
    for step in (1, 2, 3):
        verify(storage.join(target, f"step={step}.ckpt"))
    mirror.remove(storage.join(target, "step=1.ckpt"))
    mirror.remove(storage.join(target, "step=2.ckpt"))
    assert mirror.wait(timeout=120)
    assert _mirror_packs(target) == {pack_files[0], pack_files[2]}  # the first holds the backbone step 3 references
    verify(storage.join(target, "step=3.ckpt"))


def test_a_fit_mirrors_dedupe_checkpoints_with_their_packs_and_collects_both_tiers(tmp_path, s3_bucket) -> None:

    lightning.seed_everything(0, verbose=False)
    url, local = f"{s3_bucket}/run", tmp_path / "local"
    keep = RetentionCheckpoint(
        dirpath=local,
        every_n_train_steps=2,
        retention=RetentionPolicy(keep_last=2),
        mirror=Mirror(url, local_keep_last=1),
    )
    trainer = tiny_trainer([keep], plugins=[SafetensorsCheckpointIO(dedupe=True)], max_steps=10, limit_train_batches=16)
    trainer.fit(FrozenFirst())
    for directory, count in ((url, 2), (str(local), 1)):
        kept = [e.path for e in storage.list_dir(directory) if e.name.endswith(".ckpt")]
        assert len(kept) == count, kept
        for path in kept:
            verify(path)
        referenced = {f"{name}.safetensors" for path in kept for name in packs_of(path)}
        assert _mirror_packs(directory) == referenced, directory


def test_the_mirror_collects_the_packs_of_an_upload_killed_before_its_file(tmp_path, target) -> None:
    local, held = tmp_path / "local", {}
    write_checkpoint(str(local / "step=1.ckpt"), state(1), A, held=held)
    orphan, _ = write_checkpoint(str(local / "step=2.ckpt"), state(2), A, held=held)
    mirror = MirrorUploader(target)
    mirror.upload(str(local / "step=1.ckpt"))
    assert mirror.wait(timeout=120)
    pack = f"{BLOCKS}/{orphan}.safetensors"
    mirror_module.copy_file(str(local / pack), storage.join(target, pack))  # uploaded, then killed before the file
    assert f"{orphan}.safetensors" in _mirror_packs(target)
    mirror.collect(A)
    assert mirror.wait(timeout=120)
    assert f"{orphan}.safetensors" not in _mirror_packs(target)
    verify(storage.join(target, "step=1.ckpt"))


def test_a_checkpoint_whose_pack_is_missing_is_not_mirrored(tmp_path) -> None:
    """Never a mirrored checkpoint without its blocks: the upload fails naming the pack, and the mirror holds nothing."""
    local, target = tmp_path / "local", str(tmp_path / "mirror")
    pack = write_checkpoint(str(local / "step=1.ckpt"), state(1), A)[0]
    (local / BLOCKS / f"{pack}.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=f"references the pack .*{pack}.safetensors, which is missing"):
        mirror_module.copy_checkpoint(str(local / "step=1.ckpt"), storage.join(target, "step=1.ckpt"))
    assert not storage.exists(storage.join(target, "step=1.ckpt"))
