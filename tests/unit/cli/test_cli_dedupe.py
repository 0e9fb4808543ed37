"""The CLI on dedupe checkpoints: ``verify`` names checkpoint, pack and key; ``consolidate`` writes a self-contained
file; ``inspect`` shows own vs shared bytes; ``prune`` collects the packs it frees; a copied directory stays valid."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from lightning_resume.cas.layout import BLOCKS
from lightning_resume.cas.refs import read_refs
from lightning_resume.cas.usage import usage
from lightning_resume.cli.main import main
from lightning_resume.format.read import load_file
from lightning_resume.io.verify import verify
from tests.helpers.compare import assert_bitwise
from tests.helpers.dedupe import state, write_checkpoint

pytestmark = pytest.mark.timeout(120)

A = "a" * 32


def _name(step: int) -> str:
    return f"step={step:09d}.ckpt"


def _owned(step: int, frozen: int = 0) -> dict:
    """A checkpoint carrying a ``RetentionCheckpoint`` record of itself (so ``prune`` may delete it)."""
    checkpoint = state(step, frozen)
    retention = {"run_id": "r" * 32, "records": [{"path": _name(step), "step": step}]}
    checkpoint["callbacks"] = {"ModelCheckpoint{'monitor': None}": {"retention": retention}}
    return checkpoint


def _saves(tmp_path, steps=(1, 2)) -> dict:
    """One checkpoint per step, each save writing only its new blocks: the first pack holds the frozen weight's
    block, which every later checkpoint references; each pack holds its step's trained weight."""
    held: dict = {}
    return {step: write_checkpoint(str(tmp_path / _name(step)), _owned(step), A, held=held) for step in steps}


def test_verify_names_the_checkpoint_the_pack_and_the_key(tmp_path, capsys) -> None:
    saved = _saves(tmp_path)
    pack2, keys2 = saved[2]
    (tmp_path / BLOCKS / f"{pack2}.safetensors").unlink()
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    failed = next(line for line in out.splitlines() if line.startswith("FAIL"))
    assert _name(2) in failed and f"{pack2}.safetensors" in failed and keys2["state_dict.head.weight"] in failed
    assert f"OK    {tmp_path / _name(1)}" in out
    assert f"newest verified: {tmp_path / _name(1)}" in out


def test_consolidate_writes_a_self_contained_file_with_the_same_tensors(tmp_path, capsys) -> None:
    _saves(tmp_path, steps=(1,))
    out = tmp_path / "alone" / "one.ckpt"
    assert main(["consolidate", str(tmp_path / _name(1)), str(out)]) == 0
    assert read_refs(str(out)).tensors == {}
    original = load_file(str(tmp_path / _name(1))).checkpoint
    shutil.rmtree(tmp_path / BLOCKS)  # it needs no pack
    verify(str(out))
    assert_bitwise(load_file(str(out)).checkpoint, original, "consolidated")
    for name, tensor in _owned(1)["state_dict"].items():
        assert torch.equal(original["state_dict"][name], tensor), name
    assert main(["consolidate", str(out), str(tmp_path / "again.ckpt")]) == 2  # nothing to consolidate


def test_a_copied_directory_stays_valid_on_its_own(tmp_path) -> None:
    _saves(tmp_path / "run")
    originals = {step: load_file(str(tmp_path / "run" / _name(step))).checkpoint for step in (1, 2)}
    subprocess.run(["cp", "-r", str(tmp_path / "run"), str(tmp_path / "copy")], check=True)
    shutil.rmtree(tmp_path / "run")
    for step in (1, 2):
        verify(str(tmp_path / "copy" / _name(step)))
        assert_bitwise(load_file(str(tmp_path / "copy" / _name(step))).checkpoint, originals[step], "copied")


def test_inspect_shows_own_and_shared_bytes(tmp_path, capsys) -> None:
    _saves(tmp_path)
    assert main(["inspect", str(tmp_path / _name(2))]) == 0
    out = capsys.readouterr().out
    block = 256 * 256 * 4
    assert f"shared  {block:>16,} bytes" in out and "own " in out and f"lineage {A}" in out
    assert main(["inspect", str(tmp_path / _name(2)), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["dedupe"]
    assert info["shared_bytes"] == block and info["own_bytes"] == info["file_bytes"] + block


def test_usage_splits_own_and_shared_bytes(tmp_path) -> None:
    _saves(tmp_path)
    first = usage(str(tmp_path / _name(1)))
    block = 256 * 256 * 4  # each weight's bytes
    assert first["referenced_bytes"] == 2 * block
    assert first["shared_bytes"] == block  # the frozen backbone, also referenced by step 2
    assert first["own_bytes"] == first["file_bytes"] + block  # its trained head
    (tmp_path / _name(2)).unlink()
    assert usage(str(tmp_path / _name(1)))["shared_bytes"] == 0


def test_prune_collects_the_packs_it_frees(tmp_path, capsys) -> None:
    saved = _saves(tmp_path, steps=(1, 2, 3))
    assert main(["prune", str(tmp_path), "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    left = {p.name for p in (tmp_path / BLOCKS).iterdir()}
    assert left == {f"{saved[1][0]}.safetensors", f"{saved[3][0]}.safetensors"}, out  # the first: the backbone
    assert f"removed pack {tmp_path / BLOCKS / saved[2][0]}.safetensors" in out
    verify(str(tmp_path / _name(3)))
