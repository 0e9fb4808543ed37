"""``consolidate`` and ``export``: outputs the product's own tools accept, from every checkpoint format we read."""

from __future__ import annotations

import os
import pathlib

import lightning as L
import pytest
import torch
from safetensors.torch import load_file as load_safetensors
from torch import nn

from lightning_resume import SafetensorsCheckpointIO, save_sharded
from lightning_resume.cli.main import main
from lightning_resume.format.read import load_file

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def sharded(tmp_path) -> str:
    state = {
        "state_dict": {"net.weight": torch.randn(3, 2), "net.bias": torch.randn(3), "count": torch.tensor(7)},
        "optimizer_0": {
            "state": {"net.weight": {"exp_avg": torch.ones(3, 2)}},
            "param_groups": [{"lr": 0.01, "params": ["net.weight"]}],
        },
    }
    meta = {"global_step": 1, "epoch": 0, "hyper_parameters": {"data": pathlib.PosixPath("/data")}}
    directory = save_sharded(state, str(tmp_path / "step-1"), step=1, meta=meta)
    return directory, state


def test_consolidate_writes_a_checkpoint_that_verify_inspect_and_the_io_plugin_accept(tmp_path, sharded, capsys):
    directory, state = sharded
    out = tmp_path / "full.safetensors"
    assert main(["consolidate", directory, str(out)]) == 0
    assert main(["verify", str(out)]) == 0
    assert main(["inspect", str(out)]) == 0 and "global_step: 1" in capsys.readouterr().out
    tree = SafetensorsCheckpointIO().load_checkpoint(str(out))
    assert torch.equal(tree["state_dict"]["net.weight"], state["state_dict"]["net.weight"])
    assert torch.equal(tree["optimizer_0"]["state"]["net.weight"]["exp_avg"], torch.ones(3, 2))
    assert tree["global_step"] == 1 and tree["optimizer_0"]["param_groups"][0]["lr"] == 0.01
    assert tree["hyper_parameters"]["data"] == pathlib.PosixPath("/data")
    assert torch.equal(tree["state_dict"]["count"], torch.tensor(7))
    with open(out, "r+b") as handle:  # one flipped data byte: the integrity record catches it
        handle.seek(-3, os.SEEK_END)
        byte = handle.read(1)
        handle.seek(-3, os.SEEK_END)
        handle.write(bytes([byte[0] ^ 0xFF]))
    assert main(["verify", str(out)]) == 1


class Tiny(L.LightningModule):
    def __init__(self, lr: float = 0.05, data_dir: pathlib.Path = pathlib.Path("/data")) -> None:
        super().__init__()
        self.save_hyperparameters()  # AttributeDict with a PosixPath: a bare torch.load(weights_only) refuses it
        self.net = nn.Linear(4, 2)

    def training_step(self, batch, _):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 2))
        return torch.utils.data.DataLoader(data, batch_size=4)


@pytest.fixture(scope="module")
def lightning_ckpts(tmp_path_factory) -> tuple:
    """The same real Lightning checkpoint as stock ``torch.save`` and through ``SafetensorsCheckpointIO``."""
    root = tmp_path_factory.mktemp("lightning")
    trainer = L.Trainer(
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(root),
    )
    model = Tiny()
    trainer.fit(model)
    trainer.save_checkpoint(str(root / "stock.ckpt"))
    SafetensorsCheckpointIO().save_checkpoint(load_file(str(root / "stock.ckpt")).checkpoint, str(root / "safe.ckpt"))
    return str(root / "stock.ckpt"), str(root / "safe.ckpt"), model.state_dict()


@pytest.mark.parametrize("which", ["stock", "safetensors"])
def test_export_reads_real_lightning_checkpoints_of_both_formats(tmp_path, lightning_ckpts, which):
    stock, safe, weights = lightning_ckpts
    out = tmp_path / "w.safetensors"
    assert main(["export", stock if which == "stock" else safe, str(out)]) == 0
    exported = load_safetensors(out)
    assert set(exported) == {"net.weight", "net.bias"} and exported["net.weight"].dtype == torch.bfloat16
    assert torch.equal(exported["net.weight"], weights["net.weight"].bfloat16())
    assert os.listdir(tmp_path) == ["w.safetensors"]  # committed through atomic_write, no temporary left


def test_export_bf16_weights_only_from_sharded_dir_and_ckpt_file(tmp_path, sharded):
    directory, state = sharded
    out = tmp_path / "w.safetensors"
    assert main(["export", directory, str(out)]) == 0
    weights = load_safetensors(out)
    assert set(weights) == {"net.weight", "net.bias", "count"}
    assert weights["net.weight"].dtype == torch.bfloat16 and weights["count"].dtype == torch.int64
    assert torch.equal(weights["net.weight"], state["state_dict"]["net.weight"].bfloat16())
    ckpt = tmp_path / "plain.ckpt"
    torch.save({"state_dict": state["state_dict"], "global_step": 3}, ckpt)
    assert main(["export", str(ckpt), str(out), "--dtype", "fp16"]) == 0
    assert load_safetensors(out)["net.bias"].dtype == torch.float16


def test_export_refuses_a_pickle_payload_and_a_corrupt_dir(tmp_path, sharded, capsys):
    directory, _ = sharded

    class Evil:
        def __reduce__(self):
            return exec, (f"open({str(tmp_path / 'pwned')!r}, 'w')",)

    ckpt = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {"w": torch.ones(1)}, "x": Evil()}, ckpt)
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"previous export")
    assert main(["export", str(ckpt), str(out)]) == 1
    assert "refused to load" in capsys.readouterr().err and not (tmp_path / "pwned").exists()
    assert out.read_bytes() == b"previous export"
    (tmp_path / "step-1" / "__0_0.distcp").write_bytes(b"x")
    assert main(["consolidate", directory, str(out)]) == 1
    assert "__0_0.distcp" in capsys.readouterr().err
