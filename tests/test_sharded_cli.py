"""``consolidate`` and ``export`` on a sharded directory and a Lightning ``.ckpt`` file."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lightning_resume.cli import main
from lightning_resume.sharded import save_sharded
from lightning_resume.sharded.meta import decode

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def sharded(tmp_path) -> str:
    state = {"state_dict": {"net.weight": torch.randn(3, 2), "net.bias": torch.randn(3), "count": torch.tensor(7)},
             "optimizer_0": {"state": {"net.weight": {"exp_avg": torch.ones(3, 2)}},
                             "param_groups": [{"lr": 0.01, "params": ["net.weight"]}]}}
    directory = save_sharded(state, str(tmp_path / "step-1"), step=1, meta={"global_step": 1, "epoch": 0})
    return directory, state


def test_consolidate_writes_every_tensor_and_the_tree(tmp_path, sharded, capsys):
    directory, state = sharded
    out = tmp_path / "full.safetensors"
    assert main(["consolidate", directory, str(out)]) == 0
    tensors = load_file(out)
    assert torch.equal(tensors["state_dict.net.weight"], state["state_dict"]["net.weight"])
    assert torch.equal(tensors["optimizer_0.state.net.weight.exp_avg"], torch.ones(3, 2))
    with safe_open(out, "pt") as handle:
        tree = decode(json.loads(handle.metadata()["lightning_resume.tree"]), tensors)
    assert tree["global_step"] == 1 and tree["optimizer_0"]["param_groups"][0]["lr"] == 0.01
    assert torch.equal(tree["state_dict"]["count"], torch.tensor(7))


def test_export_bf16_weights_only_from_sharded_dir_and_ckpt_file(tmp_path, sharded):
    directory, state = sharded
    out = tmp_path / "w.safetensors"
    assert main(["export", directory, str(out)]) == 0
    weights = load_file(out)
    assert set(weights) == {"net.weight", "net.bias", "count"}
    assert weights["net.weight"].dtype == torch.bfloat16 and weights["count"].dtype == torch.int64
    assert torch.equal(weights["net.weight"], state["state_dict"]["net.weight"].bfloat16())
    ckpt = tmp_path / "plain.ckpt"
    torch.save({"state_dict": state["state_dict"], "global_step": 3}, ckpt)
    assert main(["export", str(ckpt), str(out), "--dtype", "fp16"]) == 0
    assert load_file(out)["net.bias"].dtype == torch.float16


def test_export_refuses_a_pickle_payload_and_a_corrupt_dir(tmp_path, sharded, capsys):
    directory, _ = sharded

    class Evil:
        def __reduce__(self):
            return exec, (f"open({str(tmp_path / 'pwned')!r}, 'w')",)

    ckpt = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {"w": torch.ones(1)}, "x": Evil()}, ckpt)
    assert main(["export", str(ckpt), str(tmp_path / "o.safetensors")]) == 1
    assert "refused to load" in capsys.readouterr().err and not (tmp_path / "pwned").exists()
    (tmp_path / "step-1" / "__0_0.distcp").write_bytes(b"x")
    assert main(["consolidate", directory, str(tmp_path / "o.safetensors")]) == 1
    assert "__0_0.distcp" in capsys.readouterr().err
