"""The CLI on ``s3://`` URLs (moto server on 127.0.0.1): inspect, verify (file and directory), prune --dry-run, diff."""

from __future__ import annotations

import fsspec
import pytest
import torch

from lightning_resume.cli.main import main
from lightning_resume.io.plugin import SafetensorsCheckpointIO

pytestmark = pytest.mark.timeout(120)


def _save(url: str, step: int) -> None:
    state = {"state_dict": {"w": torch.full((4, 4), float(step))}, "global_step": step, "epoch": 0}
    SafetensorsCheckpointIO().save_checkpoint(state, url)


@pytest.fixture
def run_dir(s3_bucket: str) -> str:
    directory = f"{s3_bucket}/run"
    for step in (3, 6, 9):
        _save(f"{directory}/step={step:09d}.ckpt", step)
    return directory


def test_inspect_and_verify_a_file_on_s3(run_dir: str, capsys) -> None:
    url = f"{run_dir}/step=000000006.ckpt"
    assert main(["inspect", url]) == 0
    assert "global_step: 6" in capsys.readouterr().out
    assert main(["verify", url]) == 0
    assert f"OK    {url}" in capsys.readouterr().out


def test_verify_a_directory_on_s3_names_the_corrupt_one_and_the_newest_good(run_dir: str, capsys) -> None:
    assert main(["verify", run_dir]) == 0
    out = capsys.readouterr().out
    assert out.count("OK    s3://") == 3
    fs, key = fsspec.core.url_to_fs(f"{run_dir}/step=000000009.ckpt")
    data = bytearray(fs.cat_file(key))
    data[-2] ^= 0xFF
    fs.pipe_file(key, bytes(data))
    assert main(["verify", run_dir]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "step=000000009.ckpt" in out
    assert f"newest verified: {run_dir}/step=000000006.ckpt" in out


def test_prune_dry_run_on_s3_explains_and_deletes_nothing(run_dir: str, capsys) -> None:
    assert main(["prune", run_dir, "--keep-last", "1", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(" step=" in line for line in lines)
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    assert len(fs.ls(run_dir[len("s3://") :])) == 3


def test_diff_on_s3_and_a_missing_object_is_named_by_its_url(run_dir: str, capsys) -> None:
    assert main(["diff", f"{run_dir}/step=000000003.ckpt", f"{run_dir}/step=000000006.ckpt"]) == 0
    assert "changed" in capsys.readouterr().out
    missing = f"{run_dir}/step=000000012.ckpt"
    assert main(["diff", f"{run_dir}/step=000000003.ckpt", missing]) != 0
    assert missing in capsys.readouterr().err
