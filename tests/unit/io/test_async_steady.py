"""Issue 16's async mechanisms: buffers reused across saves, no per-tensor Python in the copy, async and
sync files alike, and a writer that yields the cores to training (failing soft where it cannot)."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lightning_resume import SafetensorsCheckpointIO
from lightning_resume import threads as worker
from lightning_resume.format import framing
from lightning_resume.staging.buffers import HostBuffers
from lightning_resume.threads import Job, OrderedWriter
from tests.helpers.compare import assert_same, tensor_bits


def _tensors(seed, shapes, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": (torch.randn(s, generator=g) * 100).to(dtype) for i, s in enumerate(shapes)}


# ------------------------------------------------------------------------------------ reuse across saves


def test_pool_views_and_layout_are_reused_while_the_signature_holds_and_rebuilt_when_shapes_change():
    buffers = HostBuffers()
    a = _tensors(0, [(64, 8), (5,), (3, 3)])
    first = buffers.stage(a)
    again = buffers.stage({k: v + 1 for k, v in a.items()})  # same signature: same views, no new layout
    assert buffers.layouts == 1 and all(again[k] is first[k] for k in a)
    b = _tensors(1, [(8, 32), (7,)], torch.float64)  # other names, dtypes and shapes, still fits the pool
    staged_b = buffers.stage(b)
    assert (buffers.allocations, buffers.layouts) == (1, 2)
    assert all(tensor_bits(staged_b[k]) == tensor_bits(v) for k, v in b.items())
    staged_a = buffers.stage(a)  # back to the first shapes: laid out again, bytes exact
    assert (buffers.allocations, buffers.layouts) == (1, 3)
    assert all(tensor_bits(staged_a[k]) == tensor_bits(v) for k, v in a.items())
    buffers.stage(_tensors(2, [(512, 64)]))  # larger: a new pool, once
    assert (buffers.allocations, buffers.layouts) == (2, 4)


def test_a_tensor_reshaped_in_place_gets_a_new_layout_not_stale_views():
    buffers, t = HostBuffers(), torch.arange(12.0)
    buffers.stage({"w": t})
    t.resize_(3, 4)
    staged = buffers.stage({"w": t})
    assert staged["w"].shape == (3, 4) and torch.equal(staged["w"], t)


def test_cpu_copies_are_batched_not_one_call_per_tensor():
    tensors = {f"p{i:04d}": torch.full((4,), float(i)) for i in range(1000)}
    buffers = HostBuffers()
    staged = buffers.prepare(tensors)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        buffers.fill(staged, tensors)
    calls = [e.name for e in prof.events() if e.cpu_parent is None]  # the operators called from Python
    assert 1 <= len(calls) < 5 and set(calls) <= {"aten::_foreach_copy_", "aten::copy_"}, calls
    assert all(torch.equal(staged[k], v) for k, v in tensors.items())


def test_ten_thousand_small_tensors_round_trip_through_an_async_save(tmp_path):
    g = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16]
    state = {
        "state_dict": {f"layer{i}.w": torch.randn(i % 7, generator=g).to(dtypes[i % 5]) for i in range(6_000)},
        "optimizer_states": [{"state": {j: {"step": torch.tensor(float(j))} for j in range(4_000)}}],
    }
    io = SafetensorsCheckpointIO(save="async")
    io.save_checkpoint(state, tmp_path / "a.ckpt")
    for t in state["state_dict"].values():  # after save() returns the snapshot is taken
        t.zero_()
    io.teardown()
    loaded = SafetensorsCheckpointIO().load_checkpoint(tmp_path / "a.ckpt")
    assert len(loaded["state_dict"]) == 6_000 and len(loaded["optimizer_states"][0]["state"]) == 4_000
    g = torch.Generator().manual_seed(0)
    expected = {f"layer{i}.w": torch.randn(i % 7, generator=g).to(dtypes[i % 5]) for i in range(6_000)}
    assert_same(loaded["state_dict"], expected)


# ------------------------------------------------------------------------------------ async and sync files


def _header(path):
    raw = path.read_bytes()
    return framing.parse_header(str(path), raw, len(raw))


def test_an_async_save_and_a_sync_save_of_one_state_carry_the_same_integrity_record_and_load_equal(tmp_path):
    state = {"epoch": 2, "w": torch.randn(1000, 33), "opt": {"m": torch.randn(17, dtype=torch.float64)}}
    io = SafetensorsCheckpointIO(save="async")
    io.save_checkpoint(state, tmp_path / "async.ckpt")
    io.teardown()
    SafetensorsCheckpointIO().save_checkpoint(state, tmp_path / "sync.ckpt")
    records = [_header(tmp_path / n).metadata[framing.INTEGRITY_KEY] for n in ("async.ckpt", "sync.ckpt")]
    assert records[0] == records[1]  # same algorithm, tree, per-tensor and data digests (header padding may differ)
    loaded = [SafetensorsCheckpointIO().load_checkpoint(tmp_path / n) for n in ("async.ckpt", "sync.ckpt")]
    assert_same(loaded[0], loaded[1])
    assert_same(loaded[0], state)


# ------------------------------------------------------------------------------------ writer priority


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority is Linux's")


def _priority():
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@linux_only
def test_the_writer_thread_and_the_threads_it_starts_run_below_training_priority():
    seen = {}

    def job():
        seen["writer"] = _priority()
        child = threading.Thread(target=lambda: seen.setdefault("child", _priority()))  # e.g. the hasher
        child.start()
        child.join()

    writer, before = OrderedWriter(), _priority()
    writer.wait([writer.submit(Job("write", "x", job))], timeout=120)
    assert writer.lowered is True
    assert seen["writer"] == seen["child"] == min(19, before + worker.WRITER_NICE)
    assert _priority() == before  # the training thread keeps its own


def test_priority_lowering_fails_soft_where_the_os_refuses(monkeypatch):
    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)
    monkeypatch.setattr(worker, "_ioprio_set", refuse)
    assert worker.lower_thread_priority() is False
    writer, ran = OrderedWriter(), []
    job = writer.submit(Job("write", "x", lambda: ran.append(1)))
    assert writer.wait([job], timeout=120) and ran == [1] and job.error is None
    assert writer.lowered is False


def test_nice_zero_keeps_the_creators_priority():
    seen = []
    writer = OrderedWriter(nice=0)
    writer.wait([writer.submit(Job("write", "x", lambda: seen.append(_priority())))], timeout=120)
    assert seen == [_priority()] and writer.lowered is False


# ------------------------------------------------------------------------------------ recopy during encoding


def _saver_roundtrip(tmp_path, io, state, name):
    io.save_checkpoint(state, tmp_path / name)
    io.wait()
    return SafetensorsCheckpointIO().load_checkpoint(tmp_path / name)


def test_the_next_save_of_the_same_tensors_is_copied_while_encoding_and_holds_the_values_at_save_time(tmp_path):
    io = SafetensorsCheckpointIO(save="async")
    state = {"step": 1, "w": torch.randn(300, 20), "m": {"a": torch.arange(7), "t": torch.randn(5, 4).t()}}
    _saver_roundtrip(tmp_path, io, state, "a.ckpt")
    buffers = io._saver.buffers
    for t in (state["w"], state["m"]["a"]):
        t.add_(3)  # changed in place between saves: the recopy reads them at the second save
    state["epoch"] = 2  # a new key: the tree is encoded in full (the recopy runs during full encodings only)
    loaded = _saver_roundtrip(tmp_path, io, state, "b.ckpt")
    assert buffers.adopted == 1
    assert_same(loaded, state)


def test_a_tensor_replaced_between_saves_is_not_taken_from_the_recopy(tmp_path):
    io = SafetensorsCheckpointIO(save="async")
    state = {"w": torch.randn(64, 3), "v": torch.randn(9)}
    _saver_roundtrip(tmp_path, io, state, "a.ckpt")
    state["w"] = torch.randn(64, 3)  # same name, dtype and shape; other memory (e.g. a rebuilt optimizer state)
    state["b"] = 1  # new keys: each save encoded in full, so the recopy runs
    loaded = _saver_roundtrip(tmp_path, io, state, "b.ckpt")
    assert io._saver.buffers.adopted == 0 and io._saver.buffers.partly_adopted == 1  # "w" copied again
    assert_same(loaded, state)
    state["w"].mul_(2)
    state["c"] = 1
    loaded = _saver_roundtrip(tmp_path, io, state, "c.ckpt")  # same tensors as the save before: recopied
    assert io._saver.buffers.adopted == 1
    assert_same(loaded, state)


def test_the_recopy_is_waited_for_when_encoding_fails(tmp_path, monkeypatch):
    io = SafetensorsCheckpointIO(save="async")
    state = {"w": torch.randn(1000, 100)}
    _saver_roundtrip(tmp_path, io, state, "a.ckpt")
    real = torch.Tensor.copy_

    def slow_recopy(dst, src, non_blocking=False):  # one tensor: the recopy is one copy_
        if threading.current_thread().name == "lightning-resume-recopy":
            time.sleep(0.5)
        return real(dst, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", slow_recopy)
    with pytest.raises(Exception, match="object"):
        io.save_checkpoint({**state, "bad": object()}, tmp_path / "b.ckpt")
    assert not [t for t in threading.enumerate() if t.name == "lightning-resume-recopy"]
    loaded = _saver_roundtrip(tmp_path, io, state, "c.ckpt")
    assert_same(loaded, state)
