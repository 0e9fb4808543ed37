"""``SafetensorsCheckpointIO(save="async", writer="process")``: the commit runs in a writer process.

What a user relies on: the file holds the state at the save and is written by the other process from
shared memory (a commit patched to fail in this process does not matter); a writer's own failure is
raised at the next save naming the file, and the writer goes on; a writer killed while it holds a write
fails that write with an ``AsyncWriteError`` naming its pid, leaves the previous file, and the next save
gets a new writer; the overlapped copy and a Lightning fit work with it. (Real SIGKILLs of the trainer
during a write: ``tests/integration/test_async_writer_process.py``.)
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_resume import SafetensorsCheckpointIO
from lightning_resume.errors import AsyncWriteError, WriterProcessDied
from lightning_resume.format import read, write
from tests.helpers.compare import assert_same
from tests.helpers.models import TinyMLP as Tiny
from tests.helpers.models import io_trainer as _trainer


@pytest.fixture(scope="module")
def io():
    io = SafetensorsCheckpointIO(save="async", writer="process")
    yield io
    io.teardown()


def _writer(io: SafetensorsCheckpointIO):
    process = io._saver.process
    assert process is not None
    return process


def _wait_until(condition, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_the_writer_process_writes_the_state_at_the_save_from_shared_memory(io, tmp_path, monkeypatch):
    def not_here(*args, **kwargs):
        raise AssertionError("the commit ran in the training process")

    monkeypatch.setattr(write, "commit", not_here)
    w = torch.arange(300_000, dtype=torch.float32)
    checkpoint = {"w": w, "empty": torch.zeros(0, 3), "b": torch.tensor([True, False]), "step": 7, "tag": ["x", 1.5]}
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in checkpoint.items()}
    io.save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    w.add_(1)  # after the save returned: not in the file
    assert io.wait() is True
    monkeypatch.undo()
    assert_same(io.load_checkpoint(tmp_path / "a.ckpt"), expected)
    assert os.listdir(tmp_path) == ["a.ckpt"]
    writer = _writer(io)
    assert writer.pid is not None and writer.pid != os.getpid() and writer.started == 1
    with open("/proc/self/maps") as f:
        assert "/memfd:lightning-resume-staging" in f.read(), "the pool is not anonymous shared memory"


def test_a_failed_write_in_the_writer_is_raised_at_the_next_save_and_the_writer_goes_on(io, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    io.save_checkpoint({"w": torch.ones(4)}, tmp_path / "file" / "a.ckpt")
    pid = _writer(io).pid
    with pytest.raises(AsyncWriteError, match=r"file/a\.ckpt failed: (FileExistsError|NotADirectoryError)") as info:
        io.save_checkpoint({"w": torch.ones(4), "step": 2}, tmp_path / "b.ckpt")
    assert isinstance(info.value.cause, OSError) and not (tmp_path / "file" / "a.ckpt").exists()
    io.save_checkpoint({"w": torch.ones(4), "step": 2}, tmp_path / "b.ckpt")  # reported once: saving goes on
    io.wait()
    assert _writer(io).pid == pid and read.load_file(str(tmp_path / "b.ckpt")).checkpoint["step"] == 2


def test_memory_urls_are_refused_with_a_clear_error(io):
    with pytest.raises(ValueError, match=r"memory://.*writer='thread'"):
        io.save_checkpoint({"w": torch.ones(4)}, "memory://bucket/a.ckpt")


def test_a_killed_writer_fails_its_write_naming_it_and_a_new_writer_takes_over(tmp_path):
    io = SafetensorsCheckpointIO(save="async", writer="process")
    io.save_checkpoint({"w": torch.zeros(1000), "step": 1}, tmp_path / "last.ckpt")
    io.wait()
    writer = _writer(io)
    first = writer.pid
    os.kill(first, signal.SIGSTOP)  # it holds the next write without doing it
    io.save_checkpoint({"w": torch.ones(1000), "step": 2}, tmp_path / "last.ckpt")
    time.sleep(0.2)
    assert io.write_in_flight()
    os.kill(first, signal.SIGKILL)
    _wait_until(lambda: not io.write_in_flight())
    with pytest.raises(
        AsyncWriteError, match=rf"last\.ckpt failed: WriterProcessDied: .*\(pid {first}\) was killed"
    ) as info:
        io.save_checkpoint({"w": torch.full((1000,), 3.0), "step": 3}, tmp_path / "last.ckpt")
    assert isinstance(info.value.cause, WriterProcessDied) and info.value.cause.returncode == -signal.SIGKILL
    assert [n for n in os.listdir(tmp_path) if n != "last.ckpt"] == []
    assert read.load_file(str(tmp_path / "last.ckpt")).checkpoint["step"] == 1  # the previous file, whole
    io.save_checkpoint({"w": torch.full((1000,), 3.0), "step": 3}, tmp_path / "last.ckpt")
    io.wait()
    assert read.load_file(str(tmp_path / "last.ckpt")).checkpoint["step"] == 3
    second = writer.pid
    assert second not in (None, first) and writer.started == 2

    os.kill(second, signal.SIGKILL)  # between saves: the next write finds it gone and says so
    _wait_until(lambda: _dead(second))
    io.save_checkpoint({"w": torch.full((1000,), 4.0), "step": 4}, tmp_path / "last.ckpt")
    with pytest.raises(AsyncWriteError) as info:
        io.wait()
    assert isinstance(info.value.cause, WriterProcessDied) and info.value.cause.pid == second
    assert read.load_file(str(tmp_path / "last.ckpt")).checkpoint["step"] == 3
    io.save_checkpoint({"w": torch.full((1000,), 5.0), "step": 5}, tmp_path / "last.ckpt")
    io.teardown()
    assert read.load_file(str(tmp_path / "last.ckpt")).checkpoint["step"] == 5
    assert os.listdir(tmp_path) == ["last.ckpt"] and writer.pid is None  # teardown ended the writer


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_with_the_overlapped_copy_the_next_optimizer_step_does_not_leak_into_the_file(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step():
        opt.zero_grad()
        model(torch.randn(8, 32)).pow(2).mean().backward()
        opt.step()

    io = SafetensorsCheckpointIO(save="overlapped", writer="process")
    step()
    checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "global_step": 1}
    expected = {"state_dict": type(checkpoint["state_dict"])((k, v.clone()) for k, v in model.state_dict().items())}
    io.save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    for _ in range(2):
        step()  # the first waits at the barrier for the deferred copy, then writes the parameters
    io.wait()
    assert io._saver.stats.copy is not None and io._saver.stats.copy.deferred_bytes > 0
    assert_same(io.load_checkpoint(tmp_path / "a.ckpt")["state_dict"], expected["state_dict"])
    io.teardown()


def test_a_fit_saves_through_the_writer_process_and_teardown_flushes(tmp_path):
    io = SafetensorsCheckpointIO(save="async", writer="process")
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    _trainer(tmp_path, 6, [ckpt], io).fit(Tiny())
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".ckpt")) == ["step=3.ckpt", "step=6.ckpt"]
    assert read.load_file(str(tmp_path / "step=6.ckpt")).checkpoint["global_step"] == 6
    assert _writer(io).pid is None


def test_the_writer_process_uploads_urls_through_the_same_storage_layer(s3_bucket):
    io = SafetensorsCheckpointIO(save="async", writer="process")  # started after the endpoint is set
    url = f"{s3_bucket}/run/step=1.ckpt"
    w = torch.randn(64, 8)
    io.save_checkpoint({"w": w, "global_step": 1}, url)
    io.teardown()
    loaded = SafetensorsCheckpointIO().load_checkpoint(url)  # verifies every checksum
    assert torch.equal(loaded["w"], w) and loaded["global_step"] == 1


def _staging_maps(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("/memfd:lightning-resume-staging" in line for line in f)


def test_the_writer_unmaps_the_old_pool_before_the_trainer_allocates_a_larger_one(tmp_path):
    io = SafetensorsCheckpointIO(save="async", writer="process")
    io.save_checkpoint({"w": torch.ones(1000)}, tmp_path / "a.ckpt")
    io.wait()
    pid = _writer(io).pid
    assert _staging_maps(pid) == 1
    io.reserve(64 << 20)  # a larger pool, allocated on the worker: the writer lets the old one go first
    io.wait()
    _wait_until(lambda: _staging_maps(pid) == 0)
    io.save_checkpoint({"w": torch.ones(1000), "v": torch.zeros(1 << 20)}, tmp_path / "b.ckpt")
    io.wait()
    assert _staging_maps(pid) == 1 and read.load_file(str(tmp_path / "b.ckpt")).checkpoint["v"].numel() == 1 << 20
    io.teardown()
