"""SafetensorsCheckpointIO(save="async"): what a user relies on, with real files and real fits.

The snapshot is taken before save() returns (an optimizer step right after does not leak into the
file), failures are raised on the training thread naming the file with nothing partial left,
deletions never overtake the write they follow, and teardown flushes and reports.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import types

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from lightning_resume import (
    ExactResume,
    PreemptionOptions,
    RetentionCheckpoint,
    RetentionPolicy,
    SafetensorsCheckpointIO,
    ScheduleOptions,
)
from lightning_resume.errors import AsyncWriteError, AsyncWriteWarning
from lightning_resume.format import read, write
from lightning_resume.protocols import AsyncCheckpointWriter
from tests.helpers.clocks import with_clocks
from tests.helpers.compare import assert_same
from tests.helpers.models import TinyMLP as Tiny
from tests.helpers.models import io_trainer as _trainer


class SlowIO(SafetensorsCheckpointIO):
    """Every background commit starts late: after ``delay`` seconds, or once the ``delay`` event is set, so the
    caller runs meanwhile (``_commit`` is the plugin's hook around each background write)."""

    def __init__(self, delay=0.3, save="async", **kwargs):
        super().__init__(save=save, **kwargs)
        self.delay = delay

    def _commit(self, path, tree_json, staged):
        self.delay.wait(10) if isinstance(self.delay, threading.Event) else time.sleep(self.delay)
        super()._commit(path, tree_json, staged)


def _disk_full(monkeypatch, after_bytes=100):
    """The next commits write some bytes, then fail as a full disk does (direct and page-cache writes alike)."""
    real = write.pwrite_all

    def full(fd, view, offset):
        os.pwrite(fd, b"x" * after_bytes, offset)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(write, "pwrite_all", full)
    return lambda: monkeypatch.setattr(write, "pwrite_all", real)


def _model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, opt)
    return model, opt


def _step(model, opt):
    opt.zero_grad()
    model(torch.randn(8, 64)).pow(2).mean().backward()
    opt.step()


def _checkpoint(model, opt, step):
    return {
        "state_dict": model.state_dict(),
        "optimizer_states": [opt.state_dict()],
        "global_step": step,
        "loops": {"n": [step]},
    }


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return type(tree)((k, _clone(v)) for k, v in tree.items())
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree


@pytest.mark.parametrize("save", ["async", "overlapped"])
def test_an_optimizer_step_right_after_save_does_not_leak_into_the_file(tmp_path, save):
    model, opt = _model_and_optimizer()
    io = SlowIO(save=save)
    assert isinstance(io, AsyncCheckpointWriter)
    checkpoint = _checkpoint(model, opt, 1)
    expected = _clone(checkpoint)
    io.save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    assert io.write_in_flight() and io.write_in_flight(str(tmp_path / "a.ckpt")) and not (tmp_path / "a.ckpt").exists()
    for _ in range(3):
        _step(model, opt)  # mutates parameters and Adam moments in place, while the write runs
    checkpoint["loops"]["n"].append(99)  # and the non-tensor tree
    assert io.write_in_flight()
    io.wait()
    loaded = io.load_checkpoint(tmp_path / "a.ckpt")
    assert_same(loaded, expected)
    assert not torch.equal(loaded["state_dict"]["0.weight"], model.state_dict()["0.weight"])
    io.teardown()


def test_status_and_timings_are_exposed(tmp_path):
    model, opt = _model_and_optimizer()
    io = SlowIO(0.2)
    io.save_checkpoint(_checkpoint(model, opt, 1), tmp_path / "a.ckpt")
    assert io.last_blocked_seconds < 0.2 and io.last_write_seconds is None
    io.save_checkpoint(_checkpoint(model, opt, 2), tmp_path / "b.ckpt")  # waits for a.ckpt
    assert io._saver.stats.wait_seconds > 0.1
    assert io.wait(str(tmp_path / "b.ckpt")) is True and not io.write_in_flight()
    assert io.last_write_seconds >= 0.2
    assert read.load_file(str(tmp_path / "b.ckpt")).checkpoint["global_step"] == 2


def test_deletions_never_overtake_the_write_they_follow(tmp_path):
    io = SlowIO(0)
    io.save_checkpoint({"w": torch.zeros(4)}, tmp_path / "old.ckpt")
    io.wait()
    gate = io.delay = threading.Event()
    io.save_checkpoint({"w": torch.ones(4)}, tmp_path / "new.ckpt")
    io.remove_checkpoint(tmp_path / "old.ckpt")  # the prune of a retention policy right after a save
    io.remove_checkpoint(tmp_path / "new.ckpt")  # removing a file whose write is still queued
    time.sleep(0.1)
    assert (tmp_path / "old.ckpt").exists(), "a deletion ran before the write it depends on"
    gate.set()
    io.wait()
    assert sorted(os.listdir(tmp_path)) == []  # both ran, in order: the write, then the removals


def test_disk_full_is_raised_at_the_next_save_naming_the_file_and_nothing_good_is_deleted(tmp_path, monkeypatch):
    io = SafetensorsCheckpointIO(save="async")
    io.save_checkpoint({"w": torch.zeros(4), "step": 1}, tmp_path / "step=1.ckpt")
    io.wait()
    restore = _disk_full(monkeypatch)
    io.save_checkpoint({"w": torch.ones(4), "step": 2}, tmp_path / "step=2.ckpt")
    io.remove_checkpoint(tmp_path / "step=1.ckpt")  # must not run: the file replacing it was not written
    with pytest.raises(AsyncWriteError, match=r"step=2\.ckpt.*No space left on device") as info:
        io.save_checkpoint({"w": torch.ones(4), "step": 3}, tmp_path / "step=3.ckpt")
    assert isinstance(info.value.__cause__, OSError) and info.value.cause.errno == 28
    assert sorted(os.listdir(tmp_path)) == ["step=1.ckpt"]  # no partial file, no temporary, old one kept
    assert io.load_checkpoint(tmp_path / "step=1.ckpt")["step"] == 1
    restore()
    io.save_checkpoint({"w": torch.ones(4), "step": 3}, tmp_path / "step=3.ckpt")  # reported once: training may go on
    io.teardown()
    assert sorted(os.listdir(tmp_path)) == ["step=1.ckpt", "step=3.ckpt"]


def test_teardown_waits_and_raises_a_failed_last_write(tmp_path, monkeypatch):
    io = SafetensorsCheckpointIO(save="async")
    _disk_full(monkeypatch)
    io.save_checkpoint({"w": torch.ones(4)}, tmp_path / "last.ckpt")
    with pytest.raises(AsyncWriteError, match=r"last\.ckpt"):
        io.teardown()
    assert os.listdir(tmp_path) == []


def test_on_error_warn_keeps_training_and_reports_at_teardown(tmp_path, monkeypatch):
    io = SafetensorsCheckpointIO(save="async", on_error="warn")
    _disk_full(monkeypatch)
    io.save_checkpoint({"w": torch.ones(4)}, tmp_path / "a.ckpt")
    with pytest.warns(AsyncWriteWarning, match=r"a\.ckpt"):
        io.save_checkpoint({"w": torch.ones(4)}, tmp_path / "b.ckpt")
    with pytest.warns(AsyncWriteWarning, match=r"b\.ckpt"):
        io.teardown()


def test_teardown_during_an_exception_flushes_within_flush_timeout_and_never_masks_it(tmp_path, monkeypatch):
    gate = threading.Event()
    io = SlowIO(gate, flush_timeout=0.2)
    io.save_checkpoint({"w": torch.ones(4)}, tmp_path / "a.ckpt")
    with pytest.warns(AsyncWriteWarning, match=r"a\.ckpt did not finish within flush_timeout=0.2s"):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            io.teardown()  # what Lightning does in its interrupt handler
    # the gate is still closed, so the write cannot have ended: teardown returned without waiting for it
    assert not (tmp_path / "a.ckpt").exists()
    gate.set()
    io.wait()
    assert (tmp_path / "a.ckpt").exists()


def test_a_pending_write_is_flushed_before_a_crashing_fit_exits(tmp_path):
    """An exception in training: Lightning tears down, which lets the pending write finish."""
    io = SlowIO(0.3)

    class Boom(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 3:
                raise RuntimeError("boom")

    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    with pytest.raises(RuntimeError, match="boom"):
        _trainer(tmp_path, 10, [ckpt, Boom()], io).fit(Tiny())
    assert os.listdir(tmp_path) == ["step=3.ckpt"] and not io.write_in_flight()
    assert read.load_file(str(tmp_path / "step=3.ckpt")).checkpoint["global_step"] == 3


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_directory_raises_naming_the_file(tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    target.chmod(0o555)
    io = SafetensorsCheckpointIO(save="async")
    io.save_checkpoint({"w": torch.ones(4)}, target / "a.ckpt")
    with pytest.raises(AsyncWriteError, match=r"a\.ckpt.*Permission denied"):
        io.wait()
    assert os.listdir(target) == []


# ------------------------------------------------------------------------------------ Lightning fits


def test_a_failed_write_stops_the_fit_with_the_file_named(tmp_path, monkeypatch):
    io = SafetensorsCheckpointIO(save="async")
    _disk_full(monkeypatch)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    with pytest.raises(AsyncWriteError, match=r"step=2\.ckpt.*No space left"):
        _trainer(tmp_path, 10, [ckpt], io).fit(Tiny())
    assert os.listdir(tmp_path) == []


class Watch(Callback):
    """At every batch start: the files on disk are complete, and the newest one verifies."""

    def __init__(self, dirpath):
        self.dirpath, self.seen_in_flight, self.max_files = dirpath, 0, 0

    def on_train_batch_start(self, trainer, *args):
        io = trainer.strategy.checkpoint_io
        self.seen_in_flight += io.write_in_flight()
        names = sorted(n for n in os.listdir(self.dirpath) if n.endswith(".ckpt"))
        self.max_files = max(self.max_files, len(names))
        if names:
            io.verify_checkpoint(os.path.join(self.dirpath, names[-1]))


def test_retention_prunes_in_order_and_marks_files_verified_only_once_durable(tmp_path):
    io = SlowIO(0.05)
    ret = RetentionCheckpoint(dirpath=tmp_path, retention=RetentionPolicy(keep_last=2), every_n_train_steps=1)
    watch = Watch(str(tmp_path))
    _trainer(tmp_path, 8, [ret, watch], io).fit(Tiny())
    assert watch.seen_in_flight >= 4  # training really ran while files were being written
    assert sorted(os.listdir(tmp_path)) == ["step=000000007.ckpt", "step=000000008.ckpt"]
    assert all(r.verified and not r.in_flight for r in ret._records.values())  # settled at train end
    assert watch.max_files <= 3  # while step N is written, keep_last counts only durable files: one extra
    for name in os.listdir(tmp_path):
        io.verify_checkpoint(str(tmp_path / name))


class InFlightAtSave(SlowIO):
    """Records, at each save, its file name and whether the previous background write was still in flight."""

    def __init__(self, delay):
        super().__init__(delay)
        self.in_flight_at_save = []

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.in_flight_at_save.append((os.path.basename(str(path)), self.write_in_flight()))
        super().save_checkpoint(checkpoint, path, storage_options)


class GatedIO(InFlightAtSave):
    """Each background commit waits until training has gone on past its save (``gate``, set at the next batch
    start; the save at the last step is not held), then moves the schedule's clock on by ``WRITE_S`` (the write as the
    schedule sees it) before it writes: a save that waited for its write would have blocked for ``WRITE_S``."""

    WRITE_S = 1000.0

    def __init__(self, clock):
        self.gate = threading.Event()
        super().__init__(self.gate)
        self.schedule_clock = clock
        self.last_step = False

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        if not self.last_step:
            self.gate.clear()
        super().save_checkpoint(checkpoint, path, storage_options)

    def _commit(self, path, tree_json, staged):
        self.gate.wait(60)  # liveness only: the release comes at the next step or at the end of training
        self.schedule_clock.now += self.WRITE_S
        SafetensorsCheckpointIO._commit(self, path, tree_json, staged)


def test_schedule_records_snapshot_time_as_blocking_and_the_write_once_durable(tmp_path):
    STEPS = 14
    clock = types.SimpleNamespace(now=0.0)  # the schedule's monotonic clock: only a write moves it
    io = GatedIO(clock)
    exact = with_clocks(
        ExactResume(mtbf=None, schedule=ScheduleOptions(every_n_train_steps_max=3), preemption=None),
        clock=lambda: clock.now,
    )
    ret = RetentionCheckpoint(dirpath=tmp_path, retention=RetentionPolicy(keep_last=2))
    writes_seen = []

    class NextStep(Callback):  # a write spans the next step boundary: it runs once training has gone on
        def on_train_batch_start(self, trainer, *args):
            writes_seen.append(io.write_in_flight())
            io.gate.set()
            io.wait()  # the write ends before this step runs (a lowered-priority writer may wait for idle cores)
            io.last_step = trainer.global_step == STEPS - 1  # the save at the end is not held

    _trainer(tmp_path, STEPS, [exact, ret, NextStep()], io).fit(Tiny())
    state = exact.scheduler.state
    # the write (WRITE_S on the schedule's clock, after the save returned) is not blocking time, and it is
    # recorded once durable (bound by work: the clock moves only in the write, never by a machine's speed)
    assert state.saves >= 2 and all(c < GatedIO.WRITE_S for c in state.costs), state.costs
    assert state.last_write_s is not None
    # no scheduled save started while a write was in flight (asserted at each save); the save at the end of
    # training may wait for one
    scheduled = [in_flight for name, in_flight in io.in_flight_at_save if name != f"step={STEPS:09d}.ckpt"]
    assert any(writes_seen) and len(scheduled) == state.saves and not any(scheduled), io.in_flight_at_save


def test_preemption_waits_until_the_snapshot_is_durable_before_stopping(tmp_path):
    io = SlowIO(0.3)
    exact = ExactResume(preemption=PreemptionOptions(signals=["SIGUSR1"]))
    ret = RetentionCheckpoint(dirpath=tmp_path, retention=RetentionPolicy(keep_last=2))

    class Preempt(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 4:
                os.kill(os.getpid(), __import__("signal").SIGUSR1)

        def on_train_end(self, trainer, pl_module):  # before Lightning's teardown would flush
            self.durable = not io.write_in_flight() and (tmp_path / "step=000000005.ckpt").exists()

    preempt = Preempt()
    _trainer(tmp_path, 20, [exact, ret, preempt], io).fit(Tiny())
    assert exact.preempted and preempt.durable


def _data_start(path):
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def _direct_io_works(directory):
    try:
        fd = os.open(os.path.join(directory, "probe"), os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0))
    except OSError:
        return False
    os.close(fd)
    return bool(getattr(os, "O_DIRECT", 0))


@contextlib.contextmanager
def _refused(fd):
    yield False  # what write._direct yields where O_DIRECT cannot be set on the descriptor


@pytest.mark.parametrize("direct", [True, False], ids=["direct-io", "filesystem-refuses-direct-io"])
def test_async_files_are_standard_safetensors_with_or_without_direct_io(tmp_path, monkeypatch, direct):
    from safetensors import safe_open

    if direct and not _direct_io_works(str(tmp_path)):
        pytest.skip("this filesystem refuses O_DIRECT")
    if not direct:
        monkeypatch.setattr(write, "_direct", _refused)
    model, opt = _model_and_optimizer()
    checkpoint = _checkpoint(model, opt, 1)
    checkpoint["odd"] = torch.arange(4099, dtype=torch.int8)  # the data section does not end on a block
    io = SafetensorsCheckpointIO(save="async")
    io.save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    io.teardown()
    start = _data_start(tmp_path / "a.ckpt")
    assert (start % 4096 == 0) if direct else (start % 4096 != 0)  # direct I/O pads the header to a block
    assert_same(SafetensorsCheckpointIO().load_checkpoint(tmp_path / "a.ckpt"), checkpoint)
    with safe_open(str(tmp_path / "a.ckpt"), framework="pt") as f:  # the reference reader agrees
        read = [f.get_tensor(key) for key in f.keys()]
    assert any(t.dtype == torch.int8 and torch.equal(t, checkpoint["odd"]) for t in read)
    assert any(torch.equal(t, model.state_dict()["0.weight"]) for t in read if t.shape == (64, 64))
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt"] + (["probe"] if direct else [])


def test_a_filesystem_that_refuses_the_first_direct_write_gets_a_page_cache_write(tmp_path, monkeypatch):
    import errno

    real, calls = write.pwrite_all, []

    def refuse_first(fd, view, offset):
        calls.append(offset)
        if len(calls) == 1:
            raise OSError(errno.EINVAL, "Invalid argument")  # what O_DIRECT gets where it is not supported
        return real(fd, view, offset)

    monkeypatch.setattr(write, "pwrite_all", refuse_first)
    model, opt = _model_and_optimizer()
    checkpoint = _checkpoint(model, opt, 1)
    io = SafetensorsCheckpointIO(save="async")
    io.save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    io.teardown()
    if not _direct_io_works(str(tmp_path)):
        pytest.skip("this filesystem refuses O_DIRECT at open: the probe write is never reached")
    assert _data_start(tmp_path / "a.ckpt") % 4096 != 0  # written through the page cache
    assert_same(SafetensorsCheckpointIO().load_checkpoint(tmp_path / "a.ckpt"), checkpoint)
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "probe"]
