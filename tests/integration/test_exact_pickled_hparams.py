"""A module written as the lightning-hydra-template writes one (the network and a ``functools.partial`` of the
optimizer as ``__init__`` arguments, stored by ``save_hyperparameters()``), checkpointed by Lightning's default
``TorchCheckpointIO``, SIGKILLed and relaunched with ``fit(ckpt_path="last")`` and ``ExactResume()`` (issue 39.3).

By default the relaunch is refused, naming what the files hold and the two fixes; ``lightning-resume verify``
and ``convert`` say the same of the same files. With ``fit(..., weights_only=False)`` the relaunch resumes bit
for bit, as plain Lightning loads the same files; ``verify --no-weights-only`` then calls them intact, and
``convert --no-weights-only`` converts them once the hyper-parameters it names are dropped.
"""

from __future__ import annotations

import pytest

from lightning_resume.cli.main import main
from tests.helpers import kill_resume as h

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

TEMPLATE = {  # 10 batches an epoch; a checkpoint every 4 steps and last.ckpt
    "template_hparams": True,
    "pipeline": "plain",
    "ckpt": {"save_last": True, "every_n_train_steps": 4},
}
GLOBALS = ("torch.nn.modules.linear.Linear", "functools.partial", "torch.optim.adamw.AdamW")


def test_template_hparams_are_refused_by_default_and_resume_exactly_with_weights_only_false(tmp_path, capsys):
    a = h.uninterrupted(TEMPLATE, tmp_path)
    b = h.killed(TEMPLATE, tmp_path, pause=14)  # in the second epoch, after the step-12 checkpoint
    refused = dict(TEMPLATE, out=str(tmp_path / "C-default"), ckpt_dir=b["ckpt_dir"], resume="last")
    assert h.exit_code(refused, tmp_path) != 0
    said = h.output(refused, tail=None)
    assert "NoLoadableCheckpointError" in said and all(g in said for g in GLOBALS), said[-3000:]
    assert "save_hyperparameters(ignore=" in said and "weights_only=False" in said and "sandbox" not in said

    _cli_agrees(b["ckpt_dir"], tmp_path, capsys)

    c = h.resumed(TEMPLATE, tmp_path, b["ckpt_dir"], weights_only=False)
    h.assert_exact_resume(a["out"], c["out"], resumed_after=12)


def _cli_agrees(ckpt_dir: str, tmp_path, capsys) -> None:
    capsys.readouterr()
    assert main(["verify", ckpt_dir]) == 1  # what fit(ckpt_path="last") loads by default: none of them
    out = capsys.readouterr().out
    assert "PICKLED" in out and "FAIL" not in out and all(g in out for g in GLOBALS), out
    assert main(["verify", "--no-weights-only", ckpt_dir]) == 0  # what fit(..., weights_only=False) loads
    assert "newest verified" in capsys.readouterr().out
    last, new = f"{ckpt_dir}/last.ckpt", str(tmp_path / "last.safetensors")
    assert main(["convert", last, new]) == 1  # refused, naming what it holds; nothing ran
    assert "torch.nn.modules.linear.Linear" in capsys.readouterr().err
    assert main(["convert", "--no-weights-only", last, new]) == 2  # the hyper-parameters have no encoding
    err = capsys.readouterr().err
    assert "--drop hyper_parameters.net --drop hyper_parameters.optimizer" in err, err
    drops = ["--drop", "hyper_parameters.net", "--drop", "hyper_parameters.optimizer"]
    assert main(["convert", "--no-weights-only", *drops, last, new]) == 0
    assert main(["verify", new]) == 0
