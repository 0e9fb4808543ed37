"""A resume reads the checkpoint once: ``fit(ckpt_path="last")`` with ``RetentionCheckpoint`` and the plugin.

"Last" resolution checks each candidate by its header only (``io.verify.precheck``); the load hashes every
byte as it reads and, should that hash fail, falls back to the next candidate before any state is applied.
The bytes are counted as the system sees them: the process's ``rchar`` (every byte ``read`` returned) for a
local directory, and the bytes the S3 test server sent for GET requests for ``s3://``. Before, the resolver
read and hashed the whole file and the load read it again: about 2x.
"""

from __future__ import annotations

import warnings

import lightning
import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_resume import RetentionCheckpoint, RetentionPolicy, SafetensorsCheckpointIO
from lightning_resume.errors import SkippedCheckpointWarning
from lightning_resume.storage import files as storage

pytestmark = pytest.mark.timeout(300)


class Wide(LightningModule):
    """4 MiB of weights, 12 MiB of checkpoint with Adam's moments: other reads of a fit are noise beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1024, 1024)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class ReadProbe(Callback):
    """Reads the counter when the first resumed batch starts: the resume (resolve, load, restore) is over."""

    def __init__(self, counter) -> None:
        self.counter, self.at_first_batch = counter, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.at_first_batch is None:
            self.at_first_batch = self.counter()


def rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def _fit(dirpath: str, max_steps: int, io: SafetensorsCheckpointIO, probe=None, ckpt_path=None) -> Trainer:
    lightning.seed_everything(0, verbose=False)
    retention = RetentionCheckpoint(dirpath=dirpath, retention=RetentionPolicy(keep_last=2), every_n_train_steps=2)
    trainer = Trainer(
        max_steps=max_steps,
        callbacks=[retention] + ([probe] if probe else []),
        plugins=[io],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    data = TensorDataset(torch.randn(64, 1024, generator=torch.Generator().manual_seed(0)))
    trainer.fit(Wide(), DataLoader(data, batch_size=8), ckpt_path=ckpt_path)
    return trainer


def _bytes_read_by_resume(dirpath: str, counter, io: SafetensorsCheckpointIO) -> tuple[int, int]:
    """(bytes read from ``fit(ckpt_path="last")`` to its first batch, size of the checkpoint it resumed from)."""
    _fit(dirpath, 4, SafetensorsCheckpointIO())
    newest = storage.join(dirpath, "step=000000004.ckpt")
    size = storage.size(newest)
    assert size is not None and size > 12 << 20
    probe = ReadProbe(counter)
    before = counter()
    resumed = _fit(dirpath, 6, io, probe, ckpt_path="last")
    assert resumed.global_step == 6 and io.loaded_path(newest) == newest
    return probe.at_first_batch - before, size


def test_a_local_resume_reads_the_checkpoint_once(tmp_path):
    read, size = _bytes_read_by_resume(str(tmp_path / "ckpt"), rchar, SafetensorsCheckpointIO())
    assert size <= read <= 1.05 * size, f"read {read / size:.2f}x the checkpoint"


def test_verifying_each_candidate_in_full_reads_it_twice_so_the_count_can_tell(tmp_path):
    # fallback_to_verified=False: no fallback at load, so "last" must verify its choice in full first
    read, size = _bytes_read_by_resume(
        str(tmp_path / "ckpt"), rchar, SafetensorsCheckpointIO(fallback_to_verified=False)
    )
    assert read >= 1.9 * size


def test_a_resume_from_s3_downloads_the_checkpoint_once(s3_bucket, s3_server):
    read, size = _bytes_read_by_resume(
        f"{s3_bucket}/ckpt", lambda: s3_server.traffic.get_bytes, SafetensorsCheckpointIO()
    )
    assert size <= read <= 1.05 * size, f"downloaded {read / size:.2f}x the checkpoint"


def test_when_the_newest_fails_its_hash_while_loading_the_next_candidate_is_loaded(tmp_path):
    dirpath = str(tmp_path / "ckpt")
    _fit(dirpath, 4, SafetensorsCheckpointIO())
    newest, older = (storage.join(dirpath, f"step={s:09d}.ckpt") for s in (4, 2))
    with open(newest, "r+b") as f:  # flip one byte of tensor data: the header still checks out
        f.seek(-100, 2)
        byte = f.read(1)
        f.seek(-100, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    io = SafetensorsCheckpointIO()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _fit(dirpath, 6, io, ckpt_path="last")
    messages = [str(w.message) for w in caught if issubclass(w.category, SkippedCheckpointWarning)]
    assert any(newest in m and "checksum mismatch" in m and older in m for m in messages), messages
    assert io.loaded_path(newest) == older and resumed.global_step == 6
    assert storage.exists(older), "the checkpoint actually resumed from is protected from retention"
