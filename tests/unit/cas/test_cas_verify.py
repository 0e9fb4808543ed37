"""A dedupe checkpoint whose pack is missing or whose block is corrupt: "last" passes it over, naming the
checkpoint, the pack and the key, and resumes from the newest checkpoint that verifies. Real dedupe saves
(``SafetensorsCheckpointIO(dedupe=True)``), locally and on S3; the header-level checks alone, locally."""

from __future__ import annotations

import warnings

import fsspec
import pytest
import torch

from lightning_resume.cas.layout import pack_path
from lightning_resume.cas.refs import read_refs
from lightning_resume.errors import CheckpointCorruptError, SkippedCheckpointWarning
from lightning_resume.io.plugin import SafetensorsCheckpointIO
from lightning_resume.io.verify import header_only, precheck, verify
from lightning_resume.storage import files as storage
from tests.helpers.dedupe import state, write_pack

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["local", "s3"])
def directory(request, tmp_path) -> str:
    return str(tmp_path) if request.param == "local" else f"{request.getfixturevalue('s3_bucket')}/run"


def _saves(directory: str) -> tuple:
    """Two dedupe saves of one run (the frozen weight written once); the newest's own pack and its head's key."""
    io = SafetensorsCheckpointIO(dedupe=True)
    paths = [storage.join(directory, f"step={s:09d}.ckpt") for s in (1, 2)]
    for step, path in zip((1, 2), paths):
        io.save_checkpoint(state(step), path)
    refs = read_refs(paths[1])
    assert refs.wrote is not None and refs.tensors["state_dict.head.weight"].pack == refs.wrote
    return paths, pack_path(paths[1], refs.wrote), refs.tensors["state_dict.head.weight"].key


def _flip_last_byte(url: str) -> None:
    fs, key = fsspec.core.url_to_fs(url)
    data = bytearray(fs.cat_file(key))
    data[-1] ^= 0xFF
    fs.pipe_file(key, bytes(data))


def test_last_passes_over_a_checkpoint_whose_pack_is_missing_naming_it(directory: str) -> None:
    (older, newest), pack, key = _saves(directory)
    storage.remove(pack)
    skipped: list = []
    io = SafetensorsCheckpointIO(dedupe=True)
    assert io.resolve_newest([older, newest], skipped=skipped.append) == older  # before any load
    assert len(skipped) == 1 and all(name in skipped[0] for name in (newest, pack, key)), skipped
    assert torch.equal(io.load_checkpoint(older)["state_dict"]["head.weight"], state(1)["state_dict"]["head.weight"])


def test_last_falls_back_from_a_corrupt_block_naming_it(directory: str) -> None:
    (older, newest), pack, key = _saves(directory)
    _flip_last_byte(pack)  # the newest's own pack: its headers still check, its bytes do not
    io = SafetensorsCheckpointIO(dedupe=True)
    assert io.resolve_newest([older, newest], skipped=lambda line: None) == newest
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = io.load_checkpoint(newest)
    assert torch.equal(loaded["state_dict"]["head.weight"], state(1)["state_dict"]["head.weight"])
    assert io.loaded_path(newest) == older
    (warning,) = [w for w in caught if issubclass(w.category, SkippedCheckpointWarning)]
    assert all(name in str(warning.message) for name in (newest, pack, key, older)), warning.message
    with pytest.raises(CheckpointCorruptError, match=key):
        verify(newest)


def test_the_header_checks_name_a_missing_pack_and_a_missing_block(tmp_path) -> None:
    (older, newest), pack, key = _saves(str(tmp_path))
    precheck(newest)
    header_only(newest)
    storage.remove(pack)
    for check in (precheck, header_only):
        with pytest.raises(CheckpointCorruptError, match="the pack is missing") as caught:
            check(newest)
        assert pack in str(caught.value) and key in str(caught.value)
    other = write_pack(str(tmp_path), read_refs(newest).lineage, {"00" * 16: b"x" * 16})
    (tmp_path / "blocks" / f"{other}.safetensors").rename(pack)  # a pack under that name, without the block
    header_only(newest)  # what the memory tier reads: the pack exists
    with pytest.raises(CheckpointCorruptError, match="the pack has no such block") as caught:
        precheck(newest)
    assert pack in str(caught.value) and key in str(caught.value)
    precheck(older)
