"""Checksum algorithms: the streaming hasher equals the one-shot digest, files of every algorithm (and
files written by the 0.1 code, committed as fixtures) load and verify, and the default detects a
flipped bit in every region of the file."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_resume.cli.main import main
from lightning_resume.errors import CheckpointCorruptError, ConfigurationError
from lightning_resume.format import framing, integrity, read
from lightning_resume.format.framing import INTEGRITY_KEY, TREE_KEY
from lightning_resume.format.read import load_file
from lightning_resume.format.write import save_file
from lightning_resume.io.verify import verify
from tests.helpers.compare import assert_same
from tests.helpers.filesystem import rewrite_header

DATA = Path(__file__).parent / "data"
OLD = ("crc32", "sha256", "blake2b")


def _fixture_checkpoint() -> dict:
    """What ``tests/unit/io/data/v1_*.safetensors`` hold: written by lightning-resume 0.1 (crc32 default)."""
    torch.manual_seed(0)
    return {
        "state_dict": {"w": torch.randn(16, 8), "b": torch.arange(5, dtype=torch.int64), "h": torch.randn(3).half()},
        "epoch": 3,
        "global_step": 42,
        "name": "fixture",
        "nested": {"lr": 0.5, "flags": [True, None]},
    }


CK = {
    "state_dict": {
        "w": torch.arange(40, dtype=torch.float32).reshape(5, 8),
        "b": torch.ones(3, dtype=torch.bfloat16),
        "e": torch.empty(0, 4),
        "i": torch.arange(7, dtype=torch.int8),
    },
    "global_step": 9,
    "hp": {"lr": 0.1},
}


@pytest.mark.parametrize("algorithm", integrity.ALGORITHMS)
@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=3000), cuts=st.lists(st.integers(0, 3000), max_size=6))
def test_streaming_hasher_equals_one_shot_digest_for_any_chunking(algorithm, data, cuts):
    h = integrity.hasher(algorithm)
    bounds = [0, *sorted(c for c in cuts if c <= len(data)), len(data)]
    view = memoryview(data)
    for a, b in zip(bounds, bounds[1:]):
        h.update(view[a:b])
    assert h.hexdigest() == integrity.digest(algorithm, data)


@pytest.mark.parametrize("algorithm", integrity.ALGORITHMS)
def test_hasher_takes_tensor_memory_in_large_chunks(algorithm):
    t = torch.randn(300_000)
    whole = framing.host_bytes(t)
    h = integrity.hasher(algorithm)
    for start in range(0, len(whole), 1 << 18):
        h.update(whole[start : start + (1 << 18)])
    assert h.hexdigest() == integrity.digest(algorithm, bytes(whole))


def test_algorithm_tables_agree_and_default_is_fast():
    assert set(integrity.HASHERS) == set(integrity.DIGESTS) == set(integrity.ALGORITHMS)
    assert set(OLD) <= set(integrity.ALGORITHMS)
    assert integrity.DEFAULT_ALGORITHM == "xxh3-128"
    # the digests differ by algorithm (a table entry wired to the wrong function would not)
    assert len({integrity.digest(a, b"abc") for a in integrity.ALGORITHMS}) == len(integrity.ALGORITHMS)
    assert integrity.digest("xxh3-128", b"") == "99aa06d3014798d86001c324468d497f"  # the published XXH3-128 of ""
    assert integrity.digest("crc32", b"123456789") == "cbf43926"  # the CRC-32 check value


def test_unknown_algorithm_in_code_names_the_supported_ones():
    with pytest.raises(ConfigurationError, match="xxh3-128.*crc32.*sha256.*blake2b"):
        integrity.hasher("md5")
    with pytest.raises(ConfigurationError, match="md5"):
        save_file(CK, "/nonexistent/never-written.ckpt", algorithm="md5")


@pytest.mark.parametrize("algorithm", OLD)
def test_files_written_by_0_1_still_load_and_verify(algorithm):
    path = str(DATA / f"v1_{algorithm}.safetensors")
    header = framing.parse_header(path, open(path, "rb").read(), os.path.getsize(path))
    assert json.loads(header.metadata[INTEGRITY_KEY])["algorithm"] == algorithm
    verify(path)
    for mmap in (False, True):
        assert_same(_fixture_checkpoint(), load_file(path, mmap=mmap).checkpoint)


@pytest.mark.parametrize("algorithm", integrity.ALGORITHMS)
def test_every_algorithm_round_trips_and_records_itself(tmp_path, algorithm):
    path = str(tmp_path / "a.ckpt")
    save_file(CK, path, algorithm=algorithm)
    header = framing.parse_header(path, open(path, "rb").read(), os.path.getsize(path))
    assert json.loads(header.metadata[INTEGRITY_KEY])["algorithm"] == algorithm
    verify(path)
    for mmap in (False, True):
        assert_same(CK, load_file(path, mmap=mmap).checkpoint)


def test_default_is_recorded_in_new_files(tmp_path):
    path = str(tmp_path / "d.ckpt")
    save_file(CK, path)
    header = framing.parse_header(path, open(path, "rb").read(), os.path.getsize(path))
    assert json.loads(header.metadata[INTEGRITY_KEY])["algorithm"] == integrity.DEFAULT_ALGORITHM


def test_unknown_algorithm_in_a_file_names_the_supported_ones(tmp_path):
    path = str(tmp_path / "u.ckpt")
    shutil.copy(DATA / "v1_crc32.safetensors", path)

    def rename(doc):
        record = json.loads(doc["__metadata__"][INTEGRITY_KEY])
        record["algorithm"] = "xxh9-512"
        doc["__metadata__"][INTEGRITY_KEY] = json.dumps(record)

    rewrite_header(path, rename)
    for check in (lambda: load_file(path), lambda: load_file(path, mmap=True), lambda: verify(path)):
        with pytest.raises(CheckpointCorruptError, match="xxh9-512") as err:
            check()
        assert all(a in str(err.value) for a in integrity.ALGORITHMS)


def _regions(path: str) -> dict:
    """Byte ranges of each region of a checkpoint file: the length prefix, header JSON keys, integrity record,
    tree, each tensor's bytes and the padding between the header and the data (if any)."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = framing.parse_header(path, raw, len(raw))
    text = raw[8 : 8 + n]
    record = json.dumps(header.metadata[INTEGRITY_KEY])[1:-1].encode()  # as escaped inside the header JSON
    tree = json.dumps(header.metadata[TREE_KEY])[1:-1].encode()
    regions = {
        "length prefix": (0, 8),
        "header JSON": (8, 8 + len(text.rstrip(b" "))),
        "tensor index": (8 + text.index(b'"dtype"'), 8 + text.index(b'"data_offsets"') + 20),
        "integrity record": (8 + text.index(record), 8 + text.index(record) + len(record)),
        "tree": (8 + text.index(tree), 8 + text.index(tree) + len(tree)),
    }
    if text.rstrip(b" ") != text:
        regions["header padding"] = (8 + len(text.rstrip(b" ")), 8 + n)
    if header.data_start > 8 + n:
        regions["data padding"] = (8 + n, header.data_start)
    for e in header.entries.values():
        if e.end > e.begin:
            regions[f"tensor {e.name}"] = (header.data_start + e.begin, header.data_start + e.end)
    assert header.data_start + max(e.end for e in header.entries.values()) == len(raw), "trailing bytes unmapped"
    return regions


@pytest.fixture(params=["default chunks", "tiny chunks"])
def chunking(request, monkeypatch):
    """Run once with the reader's real chunk sizes and once with tiny ones, so every tensor spans many
    chunks (what a large tensor does at the real sizes) and chunk boundaries fall inside tensors."""
    if request.param == "tiny chunks":
        monkeypatch.setattr(read, "CHUNK", 24)
    return request.param


@pytest.mark.parametrize("algorithm", [integrity.DEFAULT_ALGORITHM, "crc32"])
def test_a_bit_flip_in_every_region_is_refused(tmp_path, algorithm, chunking):
    path = str(tmp_path / "c.ckpt")
    save_file(CK, path, algorithm=algorithm)
    good = open(path, "rb").read()
    for mmap in (False, True):  # the untouched file loads (a reader that refuses everything fails here)
        assert_same(CK, load_file(path, mmap=mmap).checkpoint)
    verify(path)
    regions = _regions(path)
    assert {"header JSON", "tensor index", "integrity record", "tree", "tensor state_dict.w"} <= set(regions)
    for name, (lo, hi) in regions.items():
        for offset in sorted({lo, (lo + hi) // 2, hi - 1}):
            for bit in (0, 7):
                bad = bytearray(good)
                bad[offset] ^= 1 << bit
                flipped = str(tmp_path / "f.ckpt")
                with open(flipped, "wb") as f:
                    f.write(bad)
                for check in (
                    lambda: load_file(flipped),
                    lambda: load_file(flipped, mmap=True),
                    lambda: verify(flipped),
                ):
                    with pytest.raises(CheckpointCorruptError):
                        check()
                        pytest.fail(f"{algorithm}: flipped bit {bit} at {offset} ({name}) was not detected")


@pytest.mark.parametrize("algorithm", integrity.ALGORITHMS)
def test_chunked_reads_load_the_same_bytes(tmp_path, algorithm, chunking):
    path = str(tmp_path / "k.ckpt")
    big = {"w": torch.randn(1000, 3), "b": torch.arange(17, dtype=torch.int16), "s": torch.tensor(2.5)}
    save_file(big, path, algorithm=algorithm)
    assert_same(big, load_file(path).checkpoint)
    assert_same(big, load_file(path, verify=False).checkpoint)
    verify(path)


def test_convert_offers_every_algorithm_and_writes_the_default(tmp_path, capsys):
    legacy = str(tmp_path / "old.ckpt")
    torch.save({"state_dict": {"w": torch.ones(3)}, "global_step": 1}, legacy)
    for args, expected in (([], integrity.DEFAULT_ALGORITHM), (["--checksum", "sha256"], "sha256")):
        new = str(tmp_path / f"new-{expected}.ckpt")
        assert main(["convert", legacy, new, *args]) == 0
        header = framing.parse_header(new, open(new, "rb").read(), os.path.getsize(new))
        assert json.loads(header.metadata[INTEGRITY_KEY])["algorithm"] == expected
    with pytest.raises(SystemExit):
        main(["convert", legacy, str(tmp_path / "x.ckpt"), "--checksum", "md5"])
    assert "xxh3-128" in capsys.readouterr().err
