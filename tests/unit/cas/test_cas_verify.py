"""Verifying a dedupe checkpoint (``io.verify``): a missing pack, a missing block and a corrupt block are each
named by checkpoint, tensor, pack and key; an intact one verifies. Local and S3."""

from __future__ import annotations

import fsspec
import pytest

from lightning_resume.cas.layout import BLOCKS
from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.io.verify import verify
from lightning_resume.storage import files as storage
from tests.helpers.dedupe import state, write_checkpoint, write_pack

pytestmark = pytest.mark.timeout(120)

A = "a" * 32


def _saved(directory: str) -> tuple:
    path = storage.join(directory, "step=1.ckpt")
    pack, keys = write_checkpoint(path, state(1), A)
    return path, storage.join(storage.join(directory, BLOCKS), f"{pack}.safetensors"), keys


def _flip_last_byte(url: str) -> None:
    fs, key = fsspec.core.url_to_fs(url)
    data = bytearray(fs.cat_file(key))
    data[-1] ^= 0xFF
    fs.pipe_file(key, bytes(data))


@pytest.fixture(params=["local", "s3"])
def directory(request, tmp_path) -> str:
    return str(tmp_path) if request.param == "local" else f"{request.getfixturevalue('s3_bucket')}/run"


def test_an_intact_dedupe_checkpoint_verifies(directory: str) -> None:
    path, _, keys = _saved(directory)
    assert len(keys) == 2  # the two weights are referenced, the bias is inline
    verify(path)


def test_a_missing_pack_names_checkpoint_pack_and_key(directory: str) -> None:
    path, pack, keys = _saved(directory)
    storage.remove(pack)
    with pytest.raises(CheckpointCorruptError, match="the pack does not exist") as caught:
        verify(path)
    message = str(caught.value)
    assert path in message and pack in message and any(key in message for key in keys.values())


def test_a_corrupt_block_names_checkpoint_pack_and_key(directory: str) -> None:
    path, pack, keys = _saved(directory)
    _flip_last_byte(pack)  # the last block of the pack
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch") as caught:
        verify(path)
    message = str(caught.value)
    assert path in message and pack in message and any(key in message for key in keys.values())


def test_a_pack_without_the_block_names_it(tmp_path) -> None:
    path, pack, keys = _saved(str(tmp_path))
    other = write_pack(str(tmp_path), A, {"00" * 16: b"x" * 16})
    storage.remove(pack)
    (tmp_path / BLOCKS / f"{other}.safetensors").rename(pack)  # a pack under that name lacking the blocks
    with pytest.raises(CheckpointCorruptError, match="the pack has no such block") as caught:
        verify(path)
    assert pack in str(caught.value)
