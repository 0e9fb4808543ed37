"""Issue 15.1: a value either loads back as itself or the save fails naming its key path.

Each test is the attack: a value that used to save without error and then never load.
"""

import enum
import os
import re

import pytest
import torch

from lightning_resume.errors import TreeFormatError, UnencodableValueError
from lightning_resume.format.codec import decode
from lightning_resume.format.read import load_file
from lightning_resume.format.write import save_file
from lightning_resume.io.verify import problem


class Perm(enum.Flag):
    R = 1
    W = 2
    X = 4


class Bits(enum.IntFlag):
    A = 1
    B = 2


def _round_trip(tmp_path, value):
    path = str(tmp_path / "c.ckpt")
    save_file({"hparams": {"v": value}}, path)
    assert problem(path) is None, problem(path)
    return load_file(path).checkpoint["hparams"]["v"]


@pytest.mark.parametrize(
    "value",
    [re.I | re.M, re.IGNORECASE, Perm(0), Perm.R | Perm.X, Perm.R | Perm.W | Perm.X, Bits(0), Bits.A | Bits.B, Bits(8)],
    ids=repr,
)
def test_flag_combinations_and_empty_flags_round_trip(tmp_path, value):
    loaded = _round_trip(tmp_path, value)
    assert type(loaded) is type(value) and loaded == value and loaded.value == value.value


def test_enum_defined_inside_a_function_is_refused_at_save_naming_the_key(tmp_path):
    class Local(enum.Enum):
        A = 1

    path = str(tmp_path / "c.ckpt")
    with pytest.raises(UnencodableValueError) as info:
        save_file({"hparams": {"mode": Local.A}}, path)
    assert info.value.key_path == "hparams.mode"
    assert "Local" in info.value.type_name
    assert not os.path.exists(path)


def test_top_level_tensor_named_metadata_round_trips(tmp_path):
    path = str(tmp_path / "c.ckpt")
    value = torch.arange(4.0)
    save_file({"__metadata__": value, "state_dict": {"w": torch.ones(2)}}, path)
    assert problem(path) is None, problem(path)
    loaded = load_file(path).checkpoint
    assert torch.equal(loaded["__metadata__"], value)
    assert torch.equal(loaded["state_dict"]["w"], torch.ones(2))


@pytest.mark.parametrize(
    "node",
    [
        {"@": "enum", "cls": "re:RegexFlag", "value": "10"},
        {"@": "enum", "cls": "re:RegexFlag", "value": True},
        {"@": "enum", "cls": "enum:Enum"},
        {"@": "enum", "cls": f"{__name__}:Plain", "value": 1},
    ],
    ids=repr,
)
def test_hostile_enum_nodes_are_refused_as_malformed(node):
    with pytest.raises(TreeFormatError):
        decode(node, {})


class Plain(enum.Enum):
    ONE = 1
