"""Legacy torch.save checkpoints (weights-only, hostile pickles refused) and the inspect/verify/diff/convert CLI."""

from __future__ import annotations

import json
import os
import pathlib

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_resume import SafetensorsCheckpointIO
from lightning_resume.cli.main import main
from lightning_resume.errors import UnsafeCheckpointError
from lightning_resume.format.read import is_safetensors, load_file
from tests.helpers.compare import assert_same
from tests.helpers.models import TinyWithScheduler


class WithPath(TinyWithScheduler):
    def __init__(self, lr: float = 0.05, data_dir: pathlib.Path = pathlib.Path("/data")) -> None:
        super().__init__(lr)
        self.save_hyperparameters()


@pytest.fixture(scope="module")
def legacy_ckpt(tmp_path_factory):
    """A checkpoint written by stock Lightning (TorchCheckpointIO, i.e. torch.save)."""
    root = tmp_path_factory.mktemp("legacy")
    L.seed_everything(0)
    trainer = L.Trainer(default_root_dir=str(root), max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[ModelCheckpoint(dirpath=str(root), filename="old")])  # fmt: skip
    trainer.fit(WithPath())
    return str(root / "old.ckpt")


def test_legacy_lightning_checkpoint_loads_weights_only(legacy_ckpt):
    ck = SafetensorsCheckpointIO().load_checkpoint(legacy_ckpt)
    assert ck["global_step"] == 2 and ck["hyper_parameters"]["data_dir"] == pathlib.Path("/data")
    assert isinstance(ck["state_dict"]["net.0.weight"], torch.Tensor)


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_hostile_pickle_is_refused_and_payload_does_not_run(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}, "x": Payload(str(marker))}, str(evil))
    with pytest.raises(UnsafeCheckpointError, match="system") as err:
        SafetensorsCheckpointIO().load_checkpoint(str(evil))
    assert err.value.path == str(evil)
    assert main(["verify", str(evil)]) == 1
    assert main(["convert", str(evil), str(tmp_path / "new.ckpt")]) == 1
    assert not marker.exists(), "the payload ran"
    assert not (tmp_path / "new.ckpt").exists()


def test_convert_then_inspect_verify_diff(legacy_ckpt, tmp_path, capsys):
    new = str(tmp_path / "new.ckpt")
    assert main(["convert", legacy_ckpt, new]) == 0
    assert is_safetensors(new)
    assert_same(load_file(legacy_ckpt).checkpoint, load_file(new).checkpoint)
    capsys.readouterr()

    assert main(["inspect", new, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["global_step"] == 2 and info["format"] == "safetensors"
    assert info["tensor_groups"]["state_dict"]["tensors"] == 4
    assert any(name.startswith("ModelCheckpoint") for name in info["callbacks"])
    assert main(["inspect", new]) == 0
    assert "global_step: 2" in capsys.readouterr().out

    assert main(["diff", legacy_ckpt, new]) == 0
    assert "identical" in capsys.readouterr().out


def test_diff_reports_changes(tmp_path, capsys):
    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    io = SafetensorsCheckpointIO()
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.zeros(3), "gone": torch.ones(1)}}, a)
    io.save_checkpoint({"global_step": 2, "state_dict": {"w": torch.tensor([0.0, 0.5, -2.0]), "new": torch.ones(1)}}, b)
    assert main(["diff", a, b, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"added": ["state_dict.new"], "removed": ["state_dict.gone"], "changed": ["global_step", "state_dict.w"],
                   "max_abs_diff": {"state_dict": 2.0}}  # fmt: skip


def test_verify_directory_names_bad_file_and_tensor(tmp_path, capsys):
    io = SafetensorsCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(4)}}, str(tmp_path / "good.ckpt"))
    io.save_checkpoint({"state_dict": {"w": torch.ones(4)}}, str(tmp_path / "bad.ckpt"))
    with open(tmp_path / "bad.ckpt", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x7f")
    assert main(["verify", str(tmp_path / "good.ckpt")]) == 0
    capsys.readouterr()
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "OK    " + str(tmp_path / "good.ckpt") in out
    assert "FAIL" in out and "bad.ckpt" in out and "tensor 'state_dict.w'" in out
    assert main(["verify", str(tmp_path), "--json"]) == 1
    results = json.loads(capsys.readouterr().out)["results"]
    assert [r["ok"] for r in results] == [False, True]
