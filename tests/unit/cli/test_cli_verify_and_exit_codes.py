"""``lightning-resume verify`` checks everything a checkpoint holds; every subcommand exits 0 / 1 / 2 alike.

0: done and every check passed; 1: a checkpoint failed a check (corrupt, unsafe); 2: a usage error or
input that could not be read. Errors go to stderr as ``error: ...``.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from lightning_resume import save_sharded
from lightning_resume.cli.main import main
from lightning_resume.format.write import save_file

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _sharded(root: Path, name: str = "step-1", step: int = 1) -> Path:
    state = {"state_dict": {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(3)}}
    return Path(save_sharded(state, str(root / name), step=step, meta={"global_step": step}))


def _flip_byte(path: Path, offset: int = -3) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset, os.SEEK_END)
        byte = handle.read(1)
        handle.seek(offset, os.SEEK_END)
        handle.write(bytes([byte[0] ^ 0xFF]))


def test_verify_a_good_sharded_directory_exits_0(tmp_path, capsys):
    directory = _sharded(tmp_path)
    assert main(["verify", str(directory)]) == 0
    assert capsys.readouterr().out.startswith(f"OK    {directory}")


def test_verify_a_sharded_directory_with_one_corrupt_shard_exits_1_naming_it(tmp_path, capsys):
    directory = _sharded(tmp_path)
    shard = next(p for p in sorted(directory.iterdir()) if p.suffix == ".distcp")
    _flip_byte(shard)
    assert main(["verify", str(directory)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and shard.name in out and "SHA-256" in out
    assert main(["verify", str(directory), "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is False and shard.name in result["results"][0]["error"]


def test_verify_a_sharded_directory_missing_a_shard_exits_1(tmp_path, capsys):
    directory = _sharded(tmp_path)
    shard = next(p for p in sorted(directory.iterdir()) if p.suffix == ".distcp")
    shard.unlink()
    assert main(["verify", str(directory)]) == 1
    assert "missing" in capsys.readouterr().out


def test_verify_a_directory_of_checkpoints_checks_each_and_names_the_newest_good_one(tmp_path, capsys):
    save_file({"global_step": 1, "w": torch.ones(4)}, str(tmp_path / "a.ckpt"))
    _sharded(tmp_path, "b.ckpt", step=2)
    newest = _sharded(tmp_path, "c.ckpt", step=3)
    assert main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("OK ") == 3 and f"newest verified: {newest}" in out
    _flip_byte(next(p for p in sorted(newest.iterdir()) if p.suffix == ".distcp"))
    assert main(["verify", str(tmp_path), "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["newest_verified"] == str(tmp_path / "b.ckpt")


def _hostile(path: Path) -> None:
    class Payload:
        def __reduce__(self):
            return (print, ("pwned",))

    path.write_bytes(pickle.dumps({"state_dict": Payload()}))


@pytest.mark.parametrize("command", ["verify", "inspect", "convert", "export", "diff"])
def test_a_bad_checkpoint_exits_1_and_a_missing_one_2_in_every_reading_command(tmp_path, capsys, command):
    good = tmp_path / "good.ckpt"
    save_file({"global_step": 1, "state_dict": {"w": torch.ones(4)}}, str(good))
    corrupt = tmp_path / "corrupt.ckpt"
    corrupt.write_bytes(good.read_bytes()[:-5])  # truncated: the header's byte ranges run past the end
    hostile = tmp_path / "hostile.ckpt"
    _hostile(hostile)
    extra = {
        "convert": [str(tmp_path / "out.ckpt")],
        "export": [str(tmp_path / "out.safetensors")],
        "diff": [str(good)],
    }.get(command, [])
    for bad in (corrupt, hostile):
        assert main([command, str(bad), *extra]) == 1, (command, bad)
        err = capsys.readouterr().err if command != "verify" else ""
        assert command == "verify" or (err.startswith("error: ") and str(bad) in err)
    assert main([command, str(tmp_path / "missing.ckpt"), *extra]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_usage_errors_exit_2_with_the_message_on_stderr(tmp_path, capsys):
    assert main(["plan", "--mtbf", "24h"]) == 2  # neither --cost nor --size/--write-bw
    assert capsys.readouterr().err.startswith("error: ")
    assert main(["prune", str(tmp_path / "nowhere"), "--keep-last", "1"]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["prune", str(tmp_path), "--keep-last", "0"]) == 2
    assert "keep_last=0" in capsys.readouterr().err
    assert main(["verify", str(tmp_path)]) == 2  # an empty directory holds no checkpoint
    assert "no checkpoints" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["verify"])  # argparse: a missing argument
    assert exit_.value.code == 2
