"""Hostile and damaged files: only clean library errors come out, never a crash or a wrong load."""

from __future__ import annotations

import os
import struct
import tempfile
from collections import OrderedDict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_resume.errors import CheckpointCorruptError, LightningResumeError
from lightning_resume.format import framing as container
from lightning_resume.format.read import load_file
from lightning_resume.format.write import save_file
from tests.helpers.compare import assert_same
from tests.helpers.filesystem import rewrite_header

CK = {
    "epoch": 0,
    "global_step": 3,
    "state_dict": OrderedDict(
        [("w", torch.arange(12, dtype=torch.float32).reshape(3, 4)), ("b", torch.ones(2, dtype=torch.bfloat16))]
    ),
    "opt": {0: {"step": torch.tensor(3.0)}},
    "hp": {"lr": 0.5, "name": "x"},
}


@pytest.fixture(scope="module")
def good_bytes():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "g.ckpt")
        save_file(CK, path)
        with open(path, "rb") as f:
            return f.read()


def _load_bytes(data: bytes, mmap: bool = False):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.ckpt")
        with open(path, "wb") as f:
            f.write(data)
        return load_file(path, mmap=mmap).checkpoint


def _outcome(data: bytes) -> None:
    """Either a clean library error, or a load identical to the original (never a silent wrong load).

    Both readers are exercised: read-into-fresh-tensors (default) and the memory map."""
    for mmap in (False, True):
        try:
            loaded = _load_bytes(data, mmap)
        except LightningResumeError:
            continue
        assert_same(CK, loaded)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_mutated_files_give_clean_errors(good_bytes, data):
    raw = bytearray(good_bytes)
    kind = data.draw(st.sampled_from(["flip", "truncate", "splice", "length"]))
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 3))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif kind == "splice":
        i = data.draw(st.integers(0, len(raw)))
        raw[i:i] = data.draw(st.binary(min_size=1, max_size=16))
    else:
        raw[:8] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1)))
    _outcome(bytes(raw))


header_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**65), 2**65),
        st.text(max_size=5),
        st.sampled_from(["F32", "U8", "BF16"]),
    ),
    lambda kids: st.one_of(
        st.lists(kids, max_size=3),
        st.dictionaries(st.sampled_from(["dtype", "shape", "data_offsets", "x"]), kids, max_size=4),
    ),
    max_leaves=10,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entries=st.dictionaries(st.text(max_size=4), header_values, max_size=4), data=st.binary(max_size=64))
def test_malformed_headers_give_clean_errors(entries, data):
    import json

    header = json.dumps(entries).encode()
    _outcome(struct.pack("<Q", len(header)) + header + data)


def _saved(tmp_path):
    path = str(tmp_path / "c.ckpt")
    save_file(CK, path)
    return path


def test_flipped_data_byte_names_the_tensor(tmp_path):
    path = _saved(tmp_path)
    with open(path, "r+b") as f:
        f.seek(-5, os.SEEK_END)  # inside the last tensor of the data section
        b = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch") as err:
        load_file(path)
    assert err.value.path == path and "tensor '" in err.value.what
    load_file(path, verify=False)  # the opt-out skips the data hashes only


def test_truncated_file(tmp_path):
    path = _saved(tmp_path)
    os.truncate(path, os.path.getsize(path) - 3)
    with pytest.raises(CheckpointCorruptError, match="truncated|runs past"):
        load_file(path)


def test_huge_header_length_is_refused_before_allocating(tmp_path):
    path = _saved(tmp_path)
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", 2**62))
    with pytest.raises(CheckpointCorruptError, match="header length") as err:
        load_file(path)
    assert err.value.actual == 2**62


def test_lying_shape_same_byte_count(tmp_path):
    path = _saved(tmp_path)
    rewrite_header(path, lambda h: h["state_dict.w"].update(shape=[4, 3]))
    with pytest.raises(CheckpointCorruptError, match="state_dict.w.*shape") as err:
        load_file(path)
    assert err.value.expected == [3, 4] and err.value.actual == [4, 3]


def test_wrong_dtype(tmp_path):
    path = _saved(tmp_path)
    rewrite_header(path, lambda h: h["state_dict.w"].update(dtype="I32"))
    with pytest.raises(CheckpointCorruptError, match="state_dict.w.*dtype"):
        load_file(path)


def test_wrong_byte_range_for_shape(tmp_path):
    path = _saved(tmp_path)
    rewrite_header(path, lambda h: h["state_dict.w"].update(shape=[3, 5]))
    with pytest.raises(CheckpointCorruptError, match="byte range does not match"):
        load_file(path)


def test_overlapping_ranges(tmp_path):
    path = _saved(tmp_path)

    def overlap(h):
        a, b = h["state_dict.w"]["data_offsets"], h["opt.0.step"]
        b["data_offsets"] = [a[0], a[0] + 4]

    rewrite_header(path, overlap)
    with pytest.raises(CheckpointCorruptError, match="overlaps|gap"):
        load_file(path)


def test_missing_tensor(tmp_path):
    path = _saved(tmp_path)

    def drop(h):
        # remove the last tensor in file order and shrink nothing: the data section then has a gap
        last = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
        del h[last]

    rewrite_header(path, drop)
    with pytest.raises(CheckpointCorruptError):
        load_file(path)


def test_missing_tensor_with_consistent_layout(tmp_path):
    path = str(tmp_path / "m.ckpt")
    save_file({"a": torch.ones(2), "b": torch.zeros(2)}, path)
    raw = open(path, "rb").read()
    metadata = container.parse_header(path, raw, len(raw)).metadata
    only_a = (
        container.header_bytes([container.Entry("a", "F32", (2,), 0, 8)], metadata) + torch.ones(2).numpy().tobytes()
    )
    with open(path, "wb") as f:
        f.write(only_a)
    with pytest.raises(CheckpointCorruptError, match="'b' is missing"):
        load_file(path)


def test_edited_tree_is_detected(tmp_path):
    path = _saved(tmp_path)

    def edit(h):
        h["__metadata__"]["lightning_resume.tree"] = h["__metadata__"]["lightning_resume.tree"].replace(
            '"global_step":3', '"global_step":4'
        )

    rewrite_header(path, edit)
    with pytest.raises(CheckpointCorruptError, match="non-tensor state"):
        load_file(path)


def test_plain_safetensors_file_is_not_taken_for_a_checkpoint(tmp_path):
    import safetensors.torch

    path = str(tmp_path / "weights.safetensors")
    safetensors.torch.save_file({"w": torch.ones(2)}, path)
    with pytest.raises(CheckpointCorruptError, match="not a lightning-resume checkpoint"):
        load_file(path)


def test_empty_and_garbage_files(tmp_path):
    for name, content in [
        ("empty.ckpt", b""),
        ("junk.ckpt", b"hello world, not a checkpoint"),
        ("short.ckpt", b"\x01"),
    ]:
        p = tmp_path / name
        p.write_bytes(content)
        with pytest.raises(LightningResumeError):
            load_file(str(p))


json_trees = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=4),
              st.sampled_from(["dict", "odict", "tuple", "tensor", "enum", "float", "bytes", "path", "size", "npscalar", "device", "bogus",
                               "custom", "dtype", "datetime", "timedelta", "ndarray", "t", "lightning.pytorch.trainer.states:TrainerFn"])),
    lambda kids: st.one_of(st.lists(kids, max_size=3),
                           st.dictionaries(st.sampled_from(["@", "v", "i", "k", "cls", "name", "dtype", "param", "grad"]), kids, max_size=4)),
    max_leaves=12,
)  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=json_trees)
def test_hostile_tree_with_valid_checksums_gives_clean_errors(tree):
    """A crafted file can carry matching checksums; decoding its tree must still fail cleanly or succeed."""
    import json

    from lightning_resume.format import integrity
    from lightning_resume.format.read import INTEGRITY_KEY, TREE_KEY

    tree_json = json.dumps({"@": "dict", "v": {"x": tree}})
    entry = container.Entry("t", "F32", (1,), 0, 4)
    digests = {"t": integrity.digest("sha256", b"\x00" * 4)}
    meta = {TREE_KEY: tree_json, INTEGRITY_KEY: integrity.make_record("sha256", tree_json, [entry], digests)}
    try:
        _load_bytes(container.header_bytes([entry], meta) + b"\x00" * 4)
    except LightningResumeError:
        pass


def test_deeply_nested_tree_is_refused_cleanly():
    from lightning_resume.format import integrity
    from lightning_resume.format.read import INTEGRITY_KEY, TREE_KEY

    tree_json = '{"@":"dict","v":{"x":' + "[" * 100_000 + "]" * 100_000 + "}}"
    meta = {TREE_KEY: tree_json, INTEGRITY_KEY: integrity.make_record("sha256", tree_json, [], {})}
    with pytest.raises(CheckpointCorruptError):
        _load_bytes(container.header_bytes([], meta))


@pytest.mark.parametrize(
    "tree, entry",
    [
        ({"@": "device", "v": "bogus"}, container.Entry("t", "F32", (1,), 0, 4)),
        ({"@": "tensor", "k": "t", "param": True, "grad": True}, container.Entry("t", "I32", (1,), 0, 4)),
        ({"@": "tensor", "k": "t"}, container.Entry("t", "F32", (2**70, 0), 0, 0)),
    ],
    ids=["bogus-device", "grad-on-integers", "huge-dimension"],
)
def test_crafted_values_torch_refuses_give_clean_errors(tree, entry):
    """Values a well-formed file can carry but torch rejects: a library error or a clean load, never a raw one."""
    import json

    from lightning_resume.format import integrity
    from lightning_resume.format.read import INTEGRITY_KEY, TREE_KEY

    tree_json = json.dumps({"@": "dict", "v": {"x": tree}})
    nbytes = entry.end - entry.begin
    digests = {"t": integrity.digest("sha256", b"\x00" * nbytes)}
    meta = {TREE_KEY: tree_json, INTEGRITY_KEY: integrity.make_record("sha256", tree_json, [entry], digests)}
    try:
        loaded = _load_bytes(container.header_bytes([entry], meta) + b"\x00" * nbytes)
    except LightningResumeError:
        return
    assert not loaded["x"].requires_grad  # grad on integers is dropped, not raised
