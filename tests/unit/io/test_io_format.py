"""Round trip of checkpoint trees through the file format: type for type, tensors bit for bit."""

from __future__ import annotations

import argparse
import datetime as dt
import enum
import os
import pathlib
import tempfile
from collections import OrderedDict

import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.trainer.states import RunningStage, TrainerFn

from lightning_resume.format.codec import UnencodableValueError, UnknownTypeError, register_converter
from lightning_resume.format.read import load_file
from lightning_resume.format.write import save_file
from tests.helpers.compare import assert_same

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    numel = int(np.prod(shape)) if shape else 1
    raw = bytearray(draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize)))
    t = torch.frombuffer(raw, dtype=torch.uint8).clone() if raw else torch.empty(0, dtype=torch.uint8)
    if dtype == torch.bool:
        return (t & 1).bool().reshape(shape)
    t = t.view(dtype).reshape(shape)  # random bits: NaN payloads, -0.0, subnormals, inf
    return t.t() if t.dim() == 2 and draw(st.booleans()) else t  # non-contiguous views too


class Color(enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    LOW = 1


LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), st.binary(max_size=8), tensors(),
    st.sampled_from([torch.Size([2, 3]), torch.float16, torch.bfloat16, torch.device("cpu"), TrainerFn.FITTING,
                     RunningStage.TRAINING, Color.RED, Level.LOW, pathlib.Path("/a/b"), pathlib.PureWindowsPath("C:/x"),
                     dt.datetime(2024, 5, 1, 12, 0, 0, 5), dt.timedelta(days=1, microseconds=3), dt.date(2020, 1, 2),
                     np.float64(1.5), np.int32(-7), 1 + 2j]),
)  # fmt: skip
KEYS = st.one_of(st.text(max_size=6), st.integers(-5, 100))


def trees(leaves=LEAVES):
    return st.recursive(
        leaves,
        lambda kids: st.one_of(
            st.lists(kids, max_size=4),
            st.lists(kids, max_size=4).map(tuple),
            st.dictionaries(KEYS, kids, max_size=4),
            st.dictionaries(st.text(max_size=6), kids, max_size=4).map(OrderedDict),
            st.dictionaries(st.text(min_size=1, max_size=6), kids, max_size=3).map(lambda d: AttributeDict(d)),
        ),
        max_leaves=20,
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=trees())
def test_round_trip_is_exact_type_for_type(tree):
    ck = {"state": tree}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "x.ckpt")
        save_file(ck, path)
        assert_same(ck, load_file(path).checkpoint)


def test_lightning_like_checkpoint_round_trip(tmp_path):
    w = torch.randn(4, 3)
    ck = {
        "epoch": 1, "global_step": 10, "pytorch-lightning_version": "2.6.6",
        "state_dict": OrderedDict([("l.weight", w), ("head.weight", w), ("l.bias", torch.zeros(4, dtype=torch.bfloat16))]),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3)}},
                              "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1], "amsgrad": False}]}],
        "hyper_parameters": AttributeDict(lr=0.1, path=pathlib.Path("/data"), fn=TrainerFn.FITTING),
        "callbacks": {"ExactResume": {"rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                                              "python": (3, tuple(range(5)), None)}}},
        "ns": argparse.Namespace(a=1, b=[1, 2]), "blob": bytearray(b"\x00\x01"), "s": {1, 2}, "fs": frozenset({"a"}),
    }  # fmt: skip
    path = str(tmp_path / "last.ckpt")
    save_file(ck, path)
    back = load_file(path).checkpoint
    assert_same(ck, back)
    assert back["state_dict"]["l.weight"] is back["state_dict"]["head.weight"], "tied weights stay tied"


def test_shared_views_and_parameters(tmp_path):
    base = torch.arange(12, dtype=torch.float32)
    p = torch.nn.Parameter(torch.randn(3))
    ck = {
        "a": base[2:8],
        "b": base.view(3, 4).t(),
        "p": p,
        "g": torch.ones(2, requires_grad=True),
        "z": torch.tensor(7),
    }
    save_file(ck, str(tmp_path / "v.ckpt"))
    back = load_file(str(tmp_path / "v.ckpt")).checkpoint
    assert_same(ck, back)
    assert type(back["p"]) is torch.nn.Parameter and back["z"].dim() == 0


def test_safetensors_library_reads_our_files(tmp_path):
    ck = {
        "w": torch.randn(5, 2),
        "b": torch.zeros(3, dtype=torch.bfloat16),
        "i": torch.tensor([1, 2]),
        "e": torch.empty(0),
    }
    save_file(ck, str(tmp_path / "x.ckpt"))
    lib = safetensors.torch.load_file(str(tmp_path / "x.ckpt"))
    for k, t in ck.items():
        assert torch.equal(lib[k], t)


class Opaque:
    pass


def test_unencodable_value_names_key_path_and_type_and_writes_nothing(tmp_path):
    ck = {"hyper_parameters": {"model": {"cfg": Opaque()}}, "w": torch.ones(2)}
    with pytest.raises(UnencodableValueError) as err:
        save_file(ck, str(tmp_path / "x.ckpt"))
    msg = str(err.value)
    assert "hyper_parameters.model.cfg" in msg and "Opaque" in msg and "register_converter" in msg
    assert os.listdir(tmp_path) == []


def test_cycle_is_rejected(tmp_path):
    loop = []
    loop.append(loop)
    with pytest.raises(UnencodableValueError, match="cycle"):
        save_file({"x": loop}, str(tmp_path / "c.ckpt"))


class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __eq__(self, other):
        return type(other) is Point and (self.x, self.y) == (other.x, other.y)


def test_registered_converter_round_trips_and_unknown_converter_is_refused(tmp_path):
    register_converter(Point, lambda p: [p.x, p.y], lambda v: Point(*v), name="tests.Point")
    save_file({"p": Point(1, 2.5)}, str(tmp_path / "p.ckpt"))
    assert load_file(str(tmp_path / "p.ckpt")).checkpoint["p"] == Point(1, 2.5)
    from lightning_resume.format import codec as fmt

    conv = fmt._CONVERTERS_BY_NAME.pop("tests.Point")
    try:
        with pytest.raises(UnknownTypeError, match="tests.Point"):
            load_file(str(tmp_path / "p.ckpt"))
        assert load_file(str(tmp_path / "p.ckpt"), lenient=True).checkpoint["p"] == [1, 2.5]
    finally:
        fmt._CONVERTERS_BY_NAME["tests.Point"] = conv
