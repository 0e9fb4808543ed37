"""Issue 41, 9: the temporary of a save killed mid-write is removed by the next save in that directory, also
when the plugin saving there already cleaned it once (another trainer on the same directory was killed since)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_resume.io.plugin import SafetensorsCheckpointIO

_KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    from lightning_resume.format.atomic import atomic_write

    def write(f):
        f.write(b"half a checkpoint")
        f.flush()
        print("writing", flush=True)
        time.sleep(600)  # SIGKILLed here, mid-write

    atomic_write(sys.argv[1], write)
    """
)


def _temporaries(directory: Path) -> list:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


@pytest.mark.multiprocess
def test_a_killed_saves_temporary_is_removed_by_the_next_save(tmp_path: Path):
    io = SafetensorsCheckpointIO()
    state = {"state_dict": {"w": torch.ones(4)}, "global_step": 1}
    io.save_checkpoint(state, str(tmp_path / "step=1.ckpt"))  # the directory's first save: cleaned once here
    writer = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(tmp_path / "step=2.ckpt")],
        stdout=subprocess.PIPE, cwd=os.getcwd(), text=True,
    )  # fmt: skip
    assert writer.stdout is not None and writer.stdout.readline().strip() == "writing"
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=60)
    left = _temporaries(tmp_path)
    assert len(left) == 1 and f"-{writer.pid}-" in left[0]
    io.save_checkpoint(state, str(tmp_path / "step=3.ckpt"))
    assert _temporaries(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=1.ckpt", "step=3.ckpt"]
