"""Typed-JSON trees that are valid but cost quadratic time or many times their size in memory to decode.

Each test writes the attack as a real checkpoint file (a hand-made tree, every checksum recomputed as
an attacker can) and loads it: hash-flooding integer keys (multiples of 2**61 - 1 all hash to 0) in a
dict or a set, and a tree of tiny containers (3 bytes of JSON each). Each must be refused with
``CheckpointCorruptError`` naming the file and the limit, quickly and in bounded memory.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.format.read import load_file
from lightning_resume.format.write import commit
from tests.helpers.tracebacks import raised_in

MERSENNE = 2**61 - 1  # CPython reduces int hashes modulo this prime


def _write_tree(path, inner: str) -> str:
    """A checkpoint whose root dict holds ``inner`` (JSON text of one node) under the key ``x``."""
    commit(str(path), '{"@":"dict","v":{"epoch":0,"x":' + inner + "}}", {})
    return str(path)


def _colliding(n: int) -> list:
    return [k * MERSENNE for k in range(1, n + 1)]


@pytest.mark.parametrize("kind", ["dict", "set"])
def test_colliding_integer_keys_are_refused_in_linear_time(tmp_path, kind):
    keys = _colliding(16_000)
    if kind == "dict":
        inner = json.dumps({"@": "dict", "i": [[k, 0] for k in keys]})
    else:
        inner = json.dumps({"@": "set", "v": keys})
    path = _write_tree(tmp_path / f"{kind}.ckpt", inner)
    with pytest.raises(CheckpointCorruptError, match="MAX_HASH_COLLISIONS") as err:
        load_file(path)
    # refused by the linear count of hash values, before the dict or set is built (quadratic insertion)
    assert raised_in(err.value, "_check_hash_spread")
    assert path in str(err.value)


def test_keys_that_merely_look_alike_still_load(tmp_path):
    keys = list(range(0, 16_000 * 7, 7))
    path = _write_tree(tmp_path / "ok.ckpt", json.dumps({"@": "dict", "i": [[k, k] for k in keys]}))
    assert load_file(path).checkpoint["x"] == {k: k for k in keys}


def test_tree_of_tiny_containers_is_refused_before_it_is_built(tmp_path):
    # 20 MB of "[]," : about 7M lists, ~960 MB of Python objects once parsed and decoded
    path = _write_tree(tmp_path / "amp.ckpt", "[" + ",".join(["[]"] * 7_000_000) + "]")
    code = f"""
import json, resource
from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.format.read import load_file
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    load_file({path!r})
    outcome = "loaded"
except CheckpointCorruptError as err:
    outcome = str(err)
grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
print(json.dumps({{"outcome": outcome, "grown_mb": grown_mb}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "MAX_TREE_NODES" in result["outcome"] and path in result["outcome"], result
    assert result["grown_mb"] < 250, result  # the header is read (20 MB) and counted, never parsed into objects
