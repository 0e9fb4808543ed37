"""Legacy ``torch.save`` files that ``weights_only=True`` accepts but that cost unbounded time or memory.

Each test writes the attack: a pickle-memo DAG (1 KB on disk, 2**60 leaves as a tree), a list that
contains itself, a deflate bomb as ``data.pkl``. ``inspect``, ``diff``, ``convert`` and prune's read
all go through ``load_file``; each must refuse the file with ``CheckpointCorruptError`` naming it and
the limit, quickly and in little memory.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import zipfile

import pytest
import torch

from lightning_resume.cli.main import main
from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.format.read import load_file
from tests.helpers.tracebacks import raised_in


def _isolated(code: str, timeout: float = 120) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line. Returns it (or the timeout)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"timed_out": True}
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _dag_checkpoint(path, levels: int = 60) -> None:
    leaf: list = []
    for _ in range(levels):
        leaf = [leaf, leaf]  # pickle's memo stores each level once: 2**levels leaves in a tiny file
    torch.save({"state_dict": {}, "epoch": 0, "global_step": 0, "hist": leaf}, str(path))


def test_memo_dag_is_refused_by_inspect_diff_and_convert_quickly(tmp_path):
    path = tmp_path / "dag.ckpt"
    _dag_checkpoint(path)
    assert path.stat().st_size < 4096
    code = f"""
import json
from lightning_resume.cli.main import main
rcs = [main(["inspect", {str(path)!r}]), main(["diff", {str(path)!r}, {str(path)!r}]),
       main(["convert", {str(path)!r}, {str(tmp_path / "out.ckpt")!r}])]
print(json.dumps({{"rcs": rcs}}))
"""
    result = _isolated(code, timeout=600)  # liveness only: 2**60 leaves would never finish
    assert not result.get("timed_out"), "a 1 KB pickle-memo DAG made the CLI run for ever"
    assert result["rcs"] == [1, 1, 1]
    assert not (tmp_path / "out.ckpt").exists()
    with pytest.raises(CheckpointCorruptError, match="MAX_TREE_NODES") as err:
        load_file(str(path))
    assert str(path) in str(err.value)


def test_list_that_contains_itself_is_refused_not_a_recursion_error(tmp_path, capsys):
    path = tmp_path / "loop.ckpt"
    loop: list = []
    loop.append(loop)
    torch.save({"state_dict": {}, "epoch": 0, "global_step": 0, "loop": loop}, str(path))
    assert main(["inspect", str(path)]) == 1
    assert "MAX_DEPTH" in capsys.readouterr().err
    with pytest.raises(CheckpointCorruptError, match="deeper than MAX_DEPTH"):
        load_file(str(path), mmap=True)


def _deflate_bomb(path, tmp_path, megabytes: int) -> None:
    """A real ``torch.save`` zip whose ``data.pkl`` is replaced by a deflated pickle of a huge string."""
    plain = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "epoch": 0}, str(plain))
    bomb = pickle.dumps({"state_dict": {}, "epoch": 0, "pad": "a" * (megabytes << 20)}, protocol=2)
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            if info.filename.endswith("data.pkl"):
                dst.writestr(info.filename, bomb, compress_type=zipfile.ZIP_DEFLATED, compresslevel=1)
            else:
                dst.writestr(info, src.read(info))


def test_deflate_bomb_pickle_is_refused_before_it_is_inflated(tmp_path):
    path = tmp_path / "bomb.ckpt"
    _deflate_bomb(path, tmp_path, megabytes=200)
    assert path.stat().st_size < 2 << 20
    code = f"""
import json, resource
from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.format.read import load_file
from lightning_resume.retention.records import read_checkpoint_callback_state
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
outcome = []
for mmap in (False, True):
    try:
        load_file({str(path)!r}, mmap=mmap)
        outcome.append("loaded")
    except CheckpointCorruptError as err:
        outcome.append(str(err))
outcome.append(read_checkpoint_callback_state({str(path)!r}))  # prune's read of callback state
grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
print(json.dumps({{"outcome": outcome, "grown_mb": grown_mb}}))
"""
    result = _isolated(code)
    *errors, prune_state = result["outcome"]
    assert all("compressed" in o and str(path) in o for o in errors), errors
    assert prune_state is None
    assert result["grown_mb"] < 100, result


def _binunicode(text: str) -> bytes:
    raw = text.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def _flooding_pickle(n: int) -> bytes:
    """``{"state_dict": {}, "epoch": 0, "x": {k * (2**61 - 1): 0 for k in 1..n}}``, written opcode by opcode
    (building that dict here would itself take n**2 steps)."""
    pairs = b"".join(
        b"\x8a" + bytes([len(enc)]) + enc + b"K\x00"
        for enc in (pickle.encode_long(k * (2**61 - 1)) for k in range(1, n + 1))
    )
    return (
        b"\x80\x02}("
        + _binunicode("state_dict")
        + b"}"
        + _binunicode("epoch")
        + b"K\x00"
        + _binunicode("x")
        + b"}("
        + pairs
        + b"uu."
    )


def test_colliding_integer_keys_in_a_legacy_pickle_are_refused_before_unpickling(tmp_path, monkeypatch):
    path = tmp_path / "flood.ckpt"
    plain = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {}, "epoch": 0}, str(plain))
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            data = _flooding_pickle(16_000) if info.filename.endswith("data.pkl") else src.read(info)
            dst.writestr(info, data)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch's unpickler ran"))
    with pytest.raises(CheckpointCorruptError, match="MAX_HASH_COLLISIONS") as err:
        load_file(str(path))
    # refused by the linear count over the pickle's bytes, before torch's unpickler builds the dict (n**2 steps)
    assert raised_in(err.value, "_check_hash_spread")
    assert str(path) in str(err.value)


def test_a_legacy_pickle_full_of_ordinary_numbers_still_loads(tmp_path):
    path = tmp_path / "numbers.ckpt"
    history = [i / 7 for i in range(50_000)] + [2**70 + i for i in range(1000)]
    torch.save({"state_dict": {}, "epoch": 0, "history": history}, str(path))
    assert load_file(str(path)).checkpoint["history"] == history
