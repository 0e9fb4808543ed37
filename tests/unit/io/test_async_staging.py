"""The async mechanism alone: the reusable host pool (CPU, mocked CUDA, real CUDA when present) and
the ordered writer (order, deletions behind failed writes, errors handed over once)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_resume.errors import AsyncWriteError, AsyncWriteWarning
from lightning_resume.format import framing as container
from lightning_resume.format.codec import TreeText
from lightning_resume.format.framing import BLOCK
from lightning_resume.staging import buffers as pool
from lightning_resume.staging.async_save import AsyncSaver
from lightning_resume.staging.buffers import Devices, HostBuffers
from lightning_resume.threads import Job, OrderedWriter
from tests.helpers.compare import tensor_bits

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int8, torch.bool, torch.complex64]


def _state(shapes, dtypes):
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        t = torch.randn(shape, generator=g, dtype=torch.float64) * 100
        out[f"t{i}"] = (t > 0) if dtype is torch.bool else t.to(dtype)
    return out


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 5), max_size=3), st.sampled_from(DTYPES)), min_size=1, max_size=8))
def test_staged_tensors_are_bitwise_copies_laid_out_as_the_file_data_section(spec):
    tensors = _state([s for s, _ in spec], [d for _, d in spec])
    staged = HostBuffers().stage(tensors)
    image = staged.image
    base = torch.frombuffer(image, dtype=torch.uint8).data_ptr() if len(image) else 0
    assert base % BLOCK == 0 and len(image) % BLOCK == 0
    for e in container.layout(tensors):
        s, t = staged[e.name], tensors[e.name]
        assert (s.dtype, s.shape, s.is_contiguous()) == (t.dtype, t.shape, True)
        assert tensor_bits(s) == tensor_bits(t)
        if s.numel():
            assert s.data_ptr() == base + e.begin and s.data_ptr() % s.element_size() == 0
            assert s.data_ptr() != t.data_ptr()
    assert bytes(image[: container.layout(tensors)[-1].end]) == b"".join(
        bytes(container.host_bytes(tensors[e.name])) for e in container.layout(tensors)
    )


def test_pool_is_allocated_once_and_reused_across_saves():
    buffers = HostBuffers()
    state = {"w": torch.randn(100, 10), "b": torch.randn(10), "step": torch.tensor(3)}
    first = buffers.stage(state)
    ptr, base = first["w"].data_ptr(), first["step"].data_ptr()  # int64 "step" is first in the file: the pool start
    for _ in range(5):
        for t in state.values():
            t.add_(1)
        again = buffers.stage(state)
        assert again["w"].data_ptr() == ptr and torch.equal(again["w"], state["w"])
    smaller = buffers.stage({"w": torch.randn(5)})  # a smaller state fits: no reallocation either
    assert buffers.allocations == 1 and smaller["w"].data_ptr() == base
    buffers.stage({"w": torch.randn(10_000)})
    assert buffers.allocations == 2


def test_noncontiguous_conjugate_and_negative_views_are_materialised():
    base = torch.randn(6, 4, dtype=torch.complex64)
    tensors = {
        "t": base.t(),
        "conj": base.conj(),
        "neg": torch.randn(4)._neg_view(),
        "slice": torch.randn(8, 8)[::2, 1::3],
    }
    staged = HostBuffers().stage(tensors)
    for name, t in tensors.items():
        assert torch.equal(staged[name], t.resolve_conj().resolve_neg()), name
        assert not staged[name].is_conj() and not staged[name].is_neg()


class FakeCuda(Devices):
    """No GPU needed: CPU tensors stand in for CUDA ones (while ``cuda``); allocations and syncs are recorded."""

    def __init__(self, cuda=True):
        self.cuda, self.allocated, self.synced = cuda, [], []

    def is_cuda(self, t):
        return self.cuda

    def allocate(self, nbytes, pinned):
        self.allocated.append(pinned)
        return torch.empty(nbytes, dtype=torch.uint8)  # pinning needs a real accelerator

    def synchronize(self, device):
        self.synced.append(device)


def test_cuda_sources_use_a_pinned_pool_non_blocking_copies_and_one_sync_per_device(monkeypatch):
    calls = {"non_blocking": []}
    devices = FakeCuda()
    real_copy = torch.Tensor.copy_

    def spy(self, src, non_blocking=False):
        calls["non_blocking"].append(non_blocking)
        return real_copy(self, src)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    state = {"a": torch.randn(10), "b": torch.randn(3, 3), "c": torch.arange(4)}
    staged = HostBuffers(devices).stage(state)
    assert devices.allocated == [True]
    assert calls["non_blocking"] == [True, True, True]
    assert devices.synced == [torch.device("cpu")]  # one per source device, after all copies were queued
    assert all(torch.equal(staged[k], v) for k, v in state.items())


def test_a_pool_first_sized_for_cpu_is_replaced_by_a_pinned_one_for_cuda():
    devices = FakeCuda(cuda=False)
    buffers = HostBuffers(devices)
    buffers.stage({"a": torch.randn(10)})
    devices.cuda = True
    buffers.stage({"a": torch.randn(10)})
    buffers.stage({"a": torch.randn(10)})
    assert devices.allocated == [False, True] and buffers.pinned


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_staging_is_pinned_and_exact():
    state = {"w": torch.randn(1000, 100, device="cuda"), "m": torch.randn(7, device="cuda", dtype=torch.bfloat16)}
    buffers = HostBuffers()
    staged = buffers.stage(state)
    assert buffers.pinned and all(s.is_pinned() and s.device.type == "cpu" for s in staged.values())
    state["w"].add_(1)  # after stage() returns the copy is complete (synchronised)
    assert torch.equal(staged["w"] + 1, state["w"].cpu()) and torch.equal(staged["m"], state["m"].cpu())


# ------------------------------------------------------------------------------------ ordered writer


def test_jobs_run_one_at_a_time_in_submission_order():
    writer, log, gate = OrderedWriter(), [], threading.Event()
    jobs = [writer.submit(Job("write", "a", lambda: (gate.wait(5), log.append("a"))))]
    jobs += [writer.submit(Job("remove", p, lambda p=p: log.append(p))) for p in "bcde"]
    time.sleep(0.05)
    assert log == [] and len(writer.outstanding()) == 5  # nothing overtakes the blocked write
    gate.set()
    assert writer.wait(jobs, timeout=120)
    assert log == list("abcde") and writer.outstanding() == []


def test_a_deletion_behind_a_failed_write_is_skipped():
    writer, removed = OrderedWriter(), []
    failed = writer.submit(Job("write", "new", lambda: (_ for _ in ()).throw(OSError(28, "No space left on device"))))
    skipped = writer.submit(Job("remove", "old", lambda: removed.append("old"), after=failed))
    writer.wait([failed, skipped], timeout=120)
    assert skipped.skipped and removed == []
    assert [j.path for j in writer.take_failed()] == ["new"] and writer.take_failed() == []


def test_wait_times_out_and_reports_false():
    writer, gate = OrderedWriter(), threading.Event()
    job = writer.submit(Job("write", "a", lambda: gate.wait(5)))
    assert writer.wait([job], timeout=0.05) is False
    gate.set()
    assert writer.wait([job], timeout=120) is True


def _saver(write, on_error="raise"):
    return AsyncSaver(write, on_error)


def _save(saver, tensors, path):
    saver.save_text(TreeText("{}", tensors), path)  # the tree's encoding is not what these tests are about


def test_saver_raises_a_failed_write_once_at_the_next_save_naming_the_file():
    def write(path, tree_json, tensors):
        if path == "bad.ckpt":
            raise PermissionError(13, "Permission denied")

    saver = _saver(write)
    _save(saver, {"w": torch.zeros(3)}, "bad.ckpt")
    with pytest.raises(AsyncWriteError, match="bad.ckpt.*Permission denied") as info:
        _save(saver, {"w": torch.zeros(3)}, "good.ckpt")
    assert isinstance(info.value.__cause__, PermissionError) and info.value.path == "bad.ckpt"
    _save(saver, {"w": torch.zeros(3)}, "good.ckpt")  # reported once; the next save goes through
    assert saver.wait() is True


def test_saver_in_warn_mode_warns_and_goes_on():
    saver = _saver(lambda path, *_: (_ for _ in ()).throw(OSError(5, "Input/output error")), on_error="warn")
    _save(saver, {"w": torch.zeros(3)}, "a.ckpt")
    with pytest.warns(AsyncWriteWarning, match="a.ckpt.*Input/output error"):
        _save(saver, {"w": torch.zeros(3)}, "b.ckpt")
    with pytest.warns(AsyncWriteWarning, match="b.ckpt"):
        saver.wait()


def test_next_save_waits_for_the_previous_write_and_measures_the_wait():
    gate, seen = threading.Event(), []

    def write(path, tree_json, tensors):
        gate.wait(5)
        tensors.wait("w")  # the write may start before the copy is done: it reads a tensor once ready
        seen.append((path, tensors["w"].clone()))

    saver = _saver(write)
    _save(saver, {"w": torch.zeros(3)}, "a")
    threading.Timer(0.2, gate.set).start()
    _save(saver, {"w": torch.ones(3)}, "b")  # must not overwrite the pool while "a" is being written
    assert saver.stats.wait_seconds >= 0.15
    saver.wait()
    assert [p for p, _ in seen] == ["a", "b"]
    assert torch.equal(seen[0][1], torch.zeros(3)) and torch.equal(seen[1][1], torch.ones(3))
    assert saver.last_write_seconds is not None and saver.stats.blocked_seconds < saver.stats.wait_seconds


# ------------------------------------------------------------------------------------ copy/write overlap


def test_a_reader_gets_each_tensor_as_soon_as_it_is_copied_and_never_before(monkeypatch):
    """The copy of 'b' is held until the reader has read 'a': only a pipelined release lets it through."""
    monkeypatch.setattr(pool, "NOTIFY_BYTES", 0)
    buffers, tensors = (
        HostBuffers(),
        {"a": torch.full((1000,), 1.0), "b": torch.full((1000,), 2.0), "c": torch.full((10,), 3.0)},
    )
    staged = buffers.prepare(tensors)
    read_a, seen = threading.Event(), {}
    real_copy = torch.Tensor.copy_

    def copy(dst, src, non_blocking=False):
        if dst.data_ptr() == staged["b"].data_ptr():
            seen["overlapped"] = read_a.wait(5)
        return real_copy(dst, src, non_blocking=non_blocking)

    def reader():
        for name in staged:
            staged.wait(name)
            seen[name] = staged[name].clone()
            read_a.set()

    thread = threading.Thread(target=reader)
    thread.start()
    monkeypatch.setattr(torch.Tensor, "copy_", copy)
    buffers.fill(staged, tensors)
    monkeypatch.setattr(torch.Tensor, "copy_", real_copy)
    thread.join(5)
    assert seen["overlapped"] is True
    assert all(torch.equal(seen[name], t) for name, t in tensors.items())


def test_a_copy_that_fails_mid_snapshot_raises_its_own_error_once_and_leaves_no_file(tmp_path, monkeypatch):
    from lightning_resume import SafetensorsCheckpointIO

    io = SafetensorsCheckpointIO(save="async")
    state = {"a": torch.randn(1000), "b": torch.randn(1000), "c": torch.randn(1000)}
    real_copy, calls = torch.Tensor.copy_, []
    monkeypatch.setattr(pool, "NOTIFY_BYTES", 0)  # one copy_ per tensor (else they are batched in one call)

    def failing(dst, src, non_blocking=False):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # e.g. Ctrl-C in the middle of the snapshot
        return real_copy(dst, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", failing)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint(state, str(tmp_path / "a.ckpt"))
    monkeypatch.setattr(torch.Tensor, "copy_", real_copy)
    assert os.listdir(tmp_path) == [] and not io.write_in_flight()
    io.save_checkpoint(state, str(tmp_path / "b.ckpt"))  # the aborted write is not reported a second time
    io.teardown()
    loaded = SafetensorsCheckpointIO().load_checkpoint(tmp_path / "b.ckpt")
    assert os.listdir(tmp_path) == ["b.ckpt"] and all(torch.equal(loaded[k], v) for k, v in state.items())


def test_the_snapshot_is_copied_in_file_order():
    tensors = {
        "z.small": torch.zeros(3, dtype=torch.int8),
        "a.big": torch.zeros(3, dtype=torch.float64),
        "m": torch.zeros(2),
    }
    assert list(HostBuffers().prepare(tensors)) == ["a.big", "m", "z.small"]  # widest dtype first, then by name
