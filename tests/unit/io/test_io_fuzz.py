"""Fuzz targets (hypothesis) for the three readers of hostile bytes: the safetensors header, the typed-JSON
tree, and the legacy ``torch.save`` reader.

Each asserts only the documented contract: a read either succeeds or raises a ``LightningResumeError``
subclass (never a raw ``TypeError``, ``RecursionError``, ... and never a crash), within a bounded time per
input. Run briefly in CI (few examples each, ``deadline=None`` because the machines are loaded; the time
bound is a generous per-input assertion instead). Raise ``LR_FUZZ_EXAMPLES`` for a longer local session.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import tempfile
import time
from typing import Any, Callable

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lightning_resume.errors import LightningResumeError
from lightning_resume.format import codec
from lightning_resume.format.read import _decode_tree, load_file
from lightning_resume.format.write import save_file
from lightning_resume.io.verify import verify as verify_checkpoint

EXAMPLES = int(os.environ.get("LR_FUZZ_EXAMPLES", "40"))
SECONDS_PER_INPUT = 120.0  # liveness only, far above any real input (milliseconds): catches hangs, not speed
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _only_documented_errors(read: Callable[[], Any]) -> None:
    start = time.monotonic()
    try:
        read()
    except LightningResumeError:
        pass
    elapsed = time.monotonic() - start
    assert elapsed < SECONDS_PER_INPUT, f"one input took {elapsed:.1f}s"


def _read_bytes(data: bytes, verify: bool = True) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "fuzz.ckpt")
        with open(path, "wb") as f:
            f.write(data)
        _only_documented_errors(lambda: load_file(path, verify=verify))
        _only_documented_errors(lambda: verify_checkpoint(path))


def _saved(checkpoint: dict) -> bytes:
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "seed.ckpt")
        save_file(checkpoint, path)
        with open(path, "rb") as f:
            return f.read()


SEED = _saved({"state_dict": {"w": torch.arange(6.0).reshape(2, 3)}, "epoch": 1, "hp": {"lr": 0.1, "k": (1, 2)}})
HEADER_END = 8 + struct.unpack("<Q", SEED[:8])[0]


# ---------------------------------------------------------------------------------------- header

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8))
json_values = st.recursive(
    json_leaf,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)),
    max_leaves=20,
)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, HEADER_END - 1), st.integers(0, 255)), min_size=1, max_size=8))
def test_fuzz_header_mutated_bytes(edits):
    data = bytearray(SEED)
    for offset, value in edits:
        data[offset] = value
    _read_bytes(bytes(data))


@FUZZ
@given(
    st.dictionaries(st.sampled_from(["__metadata__", "w", "x", ""]), json_values, max_size=4), st.binary(max_size=64)
)
def test_fuzz_header_any_json(doc, payload):
    raw = json.dumps(doc).encode()
    _read_bytes(struct.pack("<Q", len(raw)) + raw + payload)


# ------------------------------------------------------------------------------------ typed JSON

TAGS = [
    "dict", "odict", "attrdict", "namespace", "tuple", "set", "frozenset", "size", "float", "bytes", "bytearray",
    "complex", "dtype", "device", "datetime", "date", "time", "timedelta", "path", "npscalar", "tensor", "ndarray",
    "enum", "custom", "nope",
]  # fmt: skip
FIELDS = ["v", "i", "k", "cls", "name", "value", "dtype", "param", "grad"]
tagged = st.recursive(
    json_leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.builds(
            lambda tag, fields: {"@": tag, **fields},
            st.sampled_from(TAGS),
            st.dictionaries(st.sampled_from(FIELDS), st.one_of(kids, st.lists(kids, max_size=3)), max_size=3),
        ),
    ),
    max_leaves=30,
)
TENSORS = {"t": torch.ones(2), "i": torch.arange(3)}


@FUZZ
@given(tagged, st.booleans())
def test_fuzz_typed_json_tree(tree, lenient):
    text = json.dumps({"@": "dict", "v": {"root": tree}})
    _only_documented_errors(lambda: _decode_tree("fuzz.ckpt", text, TENSORS, lenient))


@FUZZ
@given(st.text(alphabet='{}[]:,"@0123456789.-eEtrufalsn dictv', max_size=200))
def test_fuzz_typed_json_text(text):
    _only_documented_errors(lambda: _decode_tree("fuzz.ckpt", text, TENSORS, False))


def test_typed_json_tree_bounds_hold_under_fuzzing():
    assert codec.MAX_DEPTH >= 64 and codec.MAX_TREE_NODES > 0  # the fuzz relies on the documented bounds


# ---------------------------------------------------------------------------------------- legacy


def _torch_saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


LEGACY_SEED = _torch_saved({"state_dict": {"w": torch.ones(2)}, "epoch": 3, "hp": {"a": [1, 2.5, "x"]}})
PICKLE_SEED = pickle.dumps({"epoch": 3, "hp": {"a": [1, 2.5, "x", (1, 2)], "b": None}}, protocol=2)


@FUZZ
@example(edits=[(1603, 1)])  # found by this target: zipfile.is_zipfile raised BadZipFile ("span multiple disks")
@given(st.lists(st.tuples(st.integers(0, len(LEGACY_SEED) - 1), st.integers(0, 255)), min_size=1, max_size=8))
def test_fuzz_legacy_zip_mutated_bytes(edits):
    data = bytearray(LEGACY_SEED)
    for offset, value in edits:
        data[offset] = value
    _read_bytes(bytes(data), verify=False)


@FUZZ
@example(edits=[(80, 106)], tail=b"")  # found by this target: struct.error out of torch's weights-only unpickler
@given(
    st.lists(st.tuples(st.integers(0, len(PICKLE_SEED) - 1), st.integers(0, 255)), max_size=6),
    st.binary(max_size=16),
)
def test_fuzz_legacy_raw_pickle(edits, tail):
    data = bytearray(PICKLE_SEED)
    for offset, value in edits:
        data[offset] = value
    _read_bytes(bytes(data[:1]) + bytes(data[1:]) + tail, verify=False)
