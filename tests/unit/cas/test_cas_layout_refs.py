"""The content-addressed layout and the refs/pack records, read from headers alone (``cas.layout``, ``cas.refs``)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lightning_resume.cas import layout
from lightning_resume.cas.refs import PackInfo, Ref, packs_of, read_pack_header, read_refs
from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.format import framing, integrity, packs
from lightning_resume.format.write import save_file

ALG = "xxh3-128"
LINEAGE = "ab" * 16


def test_layout_names_paths_local_and_remote():
    assert layout.BLOCKS == "blocks" and layout.MIN_BLOCK_BYTES == 64 << 10
    assert layout.blocks_dir("/r/ckpts/last.ckpt") == os.path.join("/r/ckpts", "blocks")
    assert layout.pack_path("/r/ckpts/a.ckpt", "xxh3-128-00ff") == os.path.join(
        "/r/ckpts/blocks/xxh3-128-00ff.safetensors"
    )
    assert layout.blocks_dir("s3://bucket/run/a.ckpt") == "s3://bucket/run/blocks"
    assert layout.pack_path("s3://bucket/run/a.ckpt", "p") == "s3://bucket/run/blocks/p.safetensors"


def test_pack_name_is_the_digest_of_the_sorted_keys_under_the_algorithm():
    keys = ["cc" * 16, "aa" * 16, "bb" * 16]
    name = layout.pack_name(ALG, keys)
    assert name == f"{ALG}-" + integrity.digest(ALG, ",".join(sorted(keys)).encode())
    assert layout.pack_name(ALG, reversed(keys)) == name  # order does not matter: a redone save names it the same
    assert layout.pack_name("sha256", keys).startswith("sha256-") and layout.pack_name("sha256", keys) != name
    assert layout.is_pack_name(name) and not layout.is_pack_name("../x") and not layout.is_pack_name("md5-00ff00ff")


def _checkpoint_with_refs(path: str, refs_doc: object, referenced: dict, inline: dict) -> None:
    """A checkpoint file as a dedupe save writes it: ``inline`` tensors in its data section, ``referenced`` only
    in the integrity record and the refs record ``refs_doc``."""
    entries = framing.layout(inline)
    digests = {n: integrity.digest(ALG, framing.host_bytes(t)) for n, t in {**inline, **referenced}.items()}
    stand_ins = [framing.Entry(n, framing.CODES[t.dtype], tuple(t.shape), 0, 0) for n, t in referenced.items()]
    tree = '{"t":"dict","v":{}}'
    meta = {
        framing.FORMAT_KEY: framing.FORMAT_VALUE,
        framing.TREE_KEY: tree,
        framing.INTEGRITY_KEY: integrity.make_record(ALG, tree, entries + stand_ins, digests),
        packs.REFS_KEY: refs_doc if isinstance(refs_doc, str) else json.dumps(refs_doc),
    }
    with open(path, "wb") as f:
        f.write(framing.header_bytes(entries, meta))
        for e in entries:
            f.write(bytes(framing.host_bytes(inline[e.name])))


def test_read_refs_gives_each_referenced_tensor_with_its_dtype_shape_key_and_pack(tmp_path):
    frozen = torch.arange(20000, dtype=torch.float32).reshape(100, 200)
    key = integrity.digest(ALG, framing.host_bytes(frozen))
    pack = layout.pack_name(ALG, [key])
    path = str(tmp_path / "a.ckpt")
    doc = {"version": 1, "lineage": LINEAGE, "tensors": {"frozen": [pack, key]}}
    _checkpoint_with_refs(path, doc, {"frozen": frozen}, {"small": torch.ones(3)})
    refs = read_refs(path)
    assert refs.lineage == LINEAGE
    assert refs.tensors == {"frozen": Ref("frozen", "F32", (100, 200), key, pack)}
    assert packs_of(path) == {pack}


def test_a_file_without_refs_reads_as_no_refs(tmp_path):
    path = str(tmp_path / "plain.ckpt")
    save_file({"w": torch.ones(100000)}, path)
    assert read_refs(path).tensors == {} and packs_of(path) == set()


@pytest.mark.parametrize(
    "doc, what",
    [
        ("{not json", "not valid JSON"),
        ({"version": 2, "lineage": LINEAGE, "tensors": {}}, "version"),
        ({"version": 1, "tensors": {}}, "lineage"),
        ({"version": 1, "lineage": LINEAGE, "tensors": {"frozen": ["../../etc", "00"]}}, "names no pack"),
        ({"version": 1, "lineage": LINEAGE, "tensors": {"frozen": "x"}}, "malformed"),
        ({"version": 1, "lineage": LINEAGE, "tensors": {"ghost": ["PACK", "KEY"]}}, "not in the integrity record"),
        ({"version": 1, "lineage": LINEAGE, "tensors": {"frozen": ["PACK", "0" * 32]}}, "differs from the recorded"),
        ({"version": 1, "lineage": LINEAGE, "tensors": {"small": ["PACK", "KEY"]}}, "both referenced and in the data"),
    ],
)
def test_a_malformed_refs_record_is_refused_naming_the_file(tmp_path, doc, what):
    frozen = torch.zeros(100, 200)
    key = integrity.digest(ALG, framing.host_bytes(frozen))
    pack = layout.pack_name(ALG, [key])
    if isinstance(doc, dict):
        doc = json.loads(json.dumps(doc).replace("PACK", pack).replace("KEY", key))
    path = str(tmp_path / "bad.ckpt")
    _checkpoint_with_refs(path, doc, {"frozen": frozen}, {"small": torch.ones(3)})
    with pytest.raises(CheckpointCorruptError, match=what) as info:
        read_refs(path)
    assert info.value.path == path


def _pack_file(path: str, blocks: dict, record: object) -> None:
    tensors = {k: torch.frombuffer(bytearray(v), dtype=torch.uint8) for k, v in blocks.items()}
    entries = framing.layout(tensors)
    meta = {framing.FORMAT_KEY: framing.FORMAT_VALUE, packs.PACK_KEY: json.dumps(record)}
    with open(path, "wb") as f:
        f.write(framing.header_bytes(entries, meta))
        for e in entries:
            f.write(blocks[e.name])


def test_read_pack_header_gives_lineage_algorithm_and_block_sizes(tmp_path):
    a, b = b"\x01" * 100, b"\x02" * 300
    blocks = {integrity.digest(ALG, a): a, integrity.digest(ALG, b): b}
    path = str(tmp_path / "p.safetensors")
    _pack_file(path, blocks, {"version": 1, "algorithm": ALG, "lineage": LINEAGE})
    assert read_pack_header(path) == PackInfo(LINEAGE, ALG, {k: len(v) for k, v in blocks.items()})


@pytest.mark.parametrize(
    "record, what",
    [(None, "lacks"), ({"version": 1, "algorithm": "md5", "lineage": LINEAGE}, "malformed")],
)
def test_a_malformed_pack_header_is_refused_naming_the_pack(tmp_path, record, what):
    path = str(tmp_path / "p.safetensors")
    if record is None:
        save_file({"w": torch.ones(3)}, path)  # a checkpoint, not a pack
    else:
        _pack_file(path, {integrity.digest(ALG, b"x"): b"x"}, record)
    with pytest.raises(CheckpointCorruptError, match=what) as info:
        read_pack_header(path)
    assert info.value.path == path
