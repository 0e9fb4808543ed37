"""Verification survives a file being truncated in place while it is checked (no memory map, no SIGBUS).

The attack: another process truncates the checkpoint right after its header was parsed. A verifier
that memory-maps the file then touches pages past the new end and the kernel kills the process with
SIGBUS; a verifier that reads gets a short read and reports the file. Run in a fresh interpreter, so a
SIGBUS kills that one, not the test session.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import torch

from lightning_resume.format.read import load_file
from lightning_resume.format.write import save_file


def test_truncate_during_verify_is_an_error_not_a_sigbus(tmp_path):
    path = str(tmp_path / "big.ckpt")
    save_file({"state_dict": {"w": torch.ones(4 << 20)}, "epoch": 0}, path)  # 16 MB of data after the header
    code = f"""
import json, os
from lightning_resume.format import framing
from lightning_resume.io.verify import problem
parse = framing.parse_header

def parse_then_truncate(path, prefix, size):  # the concurrent writer, at the worst moment
    header = parse(path, prefix, size)
    os.truncate(path, header.data_start + 4096)
    return header

framing.parse_header = parse_then_truncate
print(json.dumps({{"problem": problem({path!r})}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode != -signal.SIGBUS, "verification memory-mapped the file and died of SIGBUS"
    assert done.returncode == 0, done.stderr[-2000:]
    reason = json.loads(done.stdout.strip().splitlines()[-1])["problem"]
    assert reason is not None and path in reason and "truncated" in reason


def test_an_mmap_load_keeps_its_values_when_the_checkpoint_is_saved_again(tmp_path):
    # what mmap=True guarantees: lightning-resume's own saves replace the file, never rewrite it in place
    path = str(tmp_path / "last.ckpt")
    save_file({"state_dict": {"w": torch.ones(1024)}}, path)
    loaded = load_file(path, mmap=True).checkpoint["state_dict"]["w"]
    save_file({"state_dict": {"w": torch.full((1024,), 7.0)}}, path)
    assert torch.equal(loaded, torch.ones(1024))
    assert torch.equal(load_file(path).checkpoint["state_dict"]["w"], torch.full((1024,), 7.0))
