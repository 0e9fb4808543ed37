"""Overlapped snapshot copies (``staging.overlap`` through ``AsyncSaver(overlapped=True)``): what is deferred,
the barrier before the next optimizer step, the copy-on-write guard and the version-counter recopy, the
mocked CUDA path. The helper thread's copy is held back (``held``) so the training thread's writes come first."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from lightning_resume.errors import AsyncWriteWarning
from lightning_resume.format import read
from lightning_resume.staging import overlap
from lightning_resume.staging.async_save import AsyncSaver, commit_staged

torch.set_num_threads(1)


@pytest.fixture
def held(monkeypatch):
    """An event: the helper thread claims nothing until it is set (the guard and the barrier still copy)."""
    gate = threading.Event()
    real = overlap.OverlappedCopy._claim

    def gated(self, start, cuda):
        gate.wait(10)
        return real(self, start, cuda)

    monkeypatch.setattr(overlap.OverlappedCopy, "_claim", gated)
    yield gate
    gate.set()


def _setup(frozen=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
    if frozen:
        model[2].requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    x = torch.randn(8, 16)
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()  # the optimizer is known from its first step, and has state
    return model, opt, x


def _saver(**kw):
    return AsyncSaver(lambda p, j, s: commit_staged(p, j, s, "xxh3-128"), overlapped=True, **kw)


def _checkpoint(model, opt):
    return {"state_dict": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    return tree


def _next_step(model, opt, x, closure, before_forward=lambda: None):
    """A forward, backward and optimizer step: given to ``step`` as its closure, or run before a plain ``step()``."""

    def forward_backward():
        before_forward()
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss

    if closure:
        opt.step(forward_backward)
    else:
        forward_backward()
        opt.step()


def _assert_saved(path, expected):
    got = read.load_file(str(path), True, None).checkpoint
    for k, v in expected["state_dict"].items():
        assert torch.equal(got["state_dict"][k], v), k
    for pid, state in expected["optimizer"]["state"].items():
        for k, v in state.items():
            assert torch.equal(got["optimizer"]["state"][pid][k], v), (pid, k)


def test_only_what_an_optimizer_steps_is_deferred_buffers_and_frozen_weights_are_copied_at_the_save(held, tmp_path):
    saver = _saver()  # first: it knows the optimizers that step after it exists
    model, opt, x = _setup(frozen=True)
    expected = _clone(_checkpoint(model, opt))
    saver.save(_checkpoint(model, opt), str(tmp_path / "a.ckpt"))
    deferred = set(saver._copy.names)
    stepped = {f"state_dict.{m}.{p}" for m in (0, 1) for p in ("weight", "bias")}  # layer 2 is frozen
    moments = {f"optimizer.state.{i}.{k}" for i in range(4) for k in ("exp_avg", "exp_avg_sq", "step")}
    assert deferred == stepped | moments  # BatchNorm's statistics and the frozen layer: copied at the save
    model.train()
    model(x)  # the forward updates BatchNorm's statistics in place: copied at the save already
    held.set()
    opt.step()  # the barrier
    assert saver.stats.copy is not None and saver.stats.copy.deferred_bytes > 0
    saver.wait()
    _assert_saved(tmp_path / "a.ckpt", expected)


def test_a_save_before_any_optimizer_step_defers_nothing(tmp_path):
    model = torch.nn.Linear(4, 4)
    saver = _saver()
    saver.save({"state_dict": model.state_dict()}, str(tmp_path / "a.ckpt"))
    assert saver._copy is None
    saver.close()


EDITS = {
    "mul_": lambda p: p.mul_(0.5),
    "data.copy_": lambda p: p.data.copy_(torch.zeros_like(p)),
    "setitem": lambda p: p.__setitem__(0, 7.0),
    "iadd": lambda p: p.__iadd__(1.0),
    "foreach": lambda p: torch._foreach_add_([p], 1.0),
    "out=": lambda p: torch.add(p, 1.0, out=p),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_in_place_edit_before_the_copy_is_saved_as_it_was_at_the_save(held, tmp_path, edit):
    saver = _saver()
    model, opt, _ = _setup()
    expected = _clone(_checkpoint(model, opt))
    saver.save(_checkpoint(model, opt), str(tmp_path / "a.ckpt"))
    with torch.no_grad():
        EDITS[edit](model[0].weight)  # an EMA-style callback between the save and the next step
    held.set()
    saver.wait()
    _assert_saved(tmp_path / "a.ckpt", expected)
    assert saver.stats.guarded == 1 and saver.stats.recopied == 0


def test_zero_grad_and_metadata_changes_are_not_writes_the_copy_stays_on_the_helper_thread(held, tmp_path):
    """The next step's ``zero_grad`` sets every ``p.grad = None``: were attribute setters or ``requires_grad_``
    taken for writes, the training thread would copy each parameter itself (or wait for the helper) there."""
    saver = _saver()
    model, opt, x = _setup()
    model(x).sum().backward()  # grads to drop, as a step leaves them
    expected = _clone(_checkpoint(model, opt))
    saver.save(_checkpoint(model, opt), str(tmp_path / "a.ckpt"))
    copy = saver._copy
    opt.zero_grad(set_to_none=True)
    model[0].weight.requires_grad_(True)
    model[2].bias.data = model[2].bias.data  # a rebinding: the saved memory is not written
    assert set(copy.state) == {overlap._PENDING} and saver._copy.stats.guarded == 0
    held.set()
    saver.wait()
    _assert_saved(tmp_path / "a.ckpt", expected)
    assert saver.stats.guarded == 0 and saver.stats.recopied == 0


def test_the_write_is_handed_to_the_worker_at_the_barrier_and_what_follows_it_keeps_its_place(held, tmp_path):
    """Until the barrier the worker is not woken (it would take the GIL from the save), yet the write counts as in
    flight, and a deletion asked for after the save runs only once the file it follows is committed."""
    saver = _saver()
    model, opt, _ = _setup()
    saver.save(_checkpoint(model, opt), str(tmp_path / "a.ckpt"))
    seen = []
    saver.remove("old.ckpt", lambda: seen.append((tmp_path / "a.ckpt").exists()))
    assert saver.writer.outstanding() == [] and saver.in_flight() and saver.in_flight(str(tmp_path / "a.ckpt"))
    assert saver.pending() == [str(tmp_path / "a.ckpt")] and not saver.in_flight(str(tmp_path / "b.ckpt"))
    held.set()
    saver.end_copy()  # the barrier, as the next optimizer step runs it
    assert [j.kind for j in saver.writer.outstanding()] in (["write", "remove"], ["remove"], [])
    saver.wait()
    assert seen == [True] and not saver.in_flight()


def test_without_the_guard_the_edit_would_reach_the_file(held, tmp_path, monkeypatch):
    """The test above can fail: with the guard passing writes through, the file holds the edited weight."""
    monkeypatch.setattr(overlap, "_written", lambda *a: [])
    saver = _saver()
    model, opt, _ = _setup()
    before = model[0].weight.detach().clone()
    saver.save(_checkpoint(model, opt), str(tmp_path / "a.ckpt"))
    with torch.no_grad():
        model[0].weight.mul_(0.5)
    held.set()
    saver.wait()
    got = read.load_file(str(tmp_path / "a.ckpt"), True, None).checkpoint["state_dict"]["0.weight"]
    assert torch.equal(got, before * 0.5)


@pytest.mark.parametrize("check_versions", [True, False])
def test_a_write_the_guard_cannot_see_is_found_by_the_version_counter_and_copied_again(
    held, tmp_path, monkeypatch, check_versions
):
    if not check_versions:  # the control: without the version-counter check the unseen write goes unnoticed
        monkeypatch.setattr(overlap.OverlappedCopy, "_recopy_changed", lambda self: None)
    saver = _saver()
    model, opt, _ = _setup()
    saver.save(_checkpoint(model, opt), str(tmp_path / "a.ckpt"))
    with torch.no_grad(), torch._C.DisableTorchFunction():  # as C++ code would: no torch function runs
        model[0].weight.mul_(0.5)
    copy = saver._copy
    held.set()
    copy.join()  # the helper copied after the edit, and saw the version change once it was done
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saver.wait()
    named = [w for w in caught if issubclass(w.category, AsyncWriteWarning) and "0.weight" in str(w.message)]
    assert (saver.stats.recopied, len(named)) == ((1, 1) if check_versions else (0, 0))


def test_a_write_after_the_copy_ended_keeps_the_copy(tmp_path):
    saver = _saver()
    model, opt, _ = _setup()
    expected = _clone(_checkpoint(model, opt))
    saver.save(_checkpoint(model, opt), str(tmp_path / "a.ckpt"))
    saver._copy.join()
    with torch.no_grad(), torch._C.DisableTorchFunction():
        model[0].weight.mul_(0.5)
    saver.wait()
    _assert_saved(tmp_path / "a.ckpt", expected)
    assert saver.stats.recopied == 0


@pytest.mark.parametrize("closure", [False, True])
def test_the_next_optimizer_step_waits_for_the_copy_after_its_closure(held, tmp_path, closure):
    saver = _saver()
    model, opt, x = _setup()
    expected = _clone(_checkpoint(model, opt))
    saver.save(_checkpoint(model, opt), str(tmp_path / "a.ckpt"))
    copy, seen = saver._copy, []

    def before_forward():
        seen.append(copy.finished)  # the closure (forward and backward) runs before the barrier
        held.set()

    _next_step(model, opt, x, closure, before_forward)
    assert seen == [False] and copy.finished and saver.stats.copy is copy.stats
    assert not torch.equal(model[0].weight, expected["state_dict"]["0.weight"])  # the step did happen
    saver.wait()
    _assert_saved(tmp_path / "a.ckpt", expected)


@pytest.mark.parametrize("finite", [True, False], ids=["stepped", "skipped_on_inf"])
def test_amp_grad_scaler_the_barrier_is_its_optimizer_step_and_a_skipped_step_keeps_the_copy_going(
    held, tmp_path, finite
):
    """``GradScaler.step`` (Lightning's 16-mixed) unscales the gradients in place, then calls ``optimizer.step``
    only if they are finite: the barrier runs there, after the backward. When the scaler skips the step, no
    barrier runs and nothing of the state changes; the copy is still in flight and the file still holds the
    state at the save."""
    saver = _saver()
    model, opt, x = _setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    expected = _clone(_checkpoint(model, opt))
    saver.save(_checkpoint(model, opt), str(tmp_path / "a.ckpt"))
    copy = saver._copy
    opt.zero_grad()
    scaler.scale(model(x).sum() * (1.0 if finite else float("inf"))).backward()
    assert not copy.finished  # the forward and the backward ran beside the copy (the scaler unscales in step)
    scaler.step(opt)
    scaler.update()
    assert copy.finished is finite  # a skipped step is no barrier: the state it would have written is unchanged
    changed = not torch.equal(model[0].weight, expected["state_dict"]["0.weight"])
    assert changed is finite
    held.set()
    saver.wait()  # ends the copy when no step did
    assert copy.finished and saver.stats.recopied == 0
    _assert_saved(tmp_path / "a.ckpt", expected)


def test_two_optimizers_the_first_step_is_the_barrier_for_both(held, tmp_path):
    saver = _saver()
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9), torch.optim.Adam(b.parameters())
    x = torch.randn(4, 8)
    for _ in range(2):
        b(a(x)).sum().backward()
        opt_a.step()
        opt_b.step()
    ckpt = {"a": a.state_dict(), "b": b.state_dict(), "oa": opt_a.state_dict(), "ob": opt_b.state_dict()}
    expected = _clone(ckpt)
    saver.save(ckpt, str(tmp_path / "a.ckpt"))
    assert len(saver._copy.names) == 4 + 2 + 3 * 2  # four parameters, momentum of two, moments and step of two
    b(a(x)).sum().backward()
    held.set()
    opt_a.step()
    assert saver._copy.finished
    opt_b.step()
    saver.wait()
    got = read.load_file(str(tmp_path / "a.ckpt"), True, None).checkpoint
    for key in ("a", "b"):
        for k, v in expected[key].items():
            assert torch.equal(got[key][k], v), (key, k)
    for key in ("oa", "ob"):
        for pid, state in expected[key]["state"].items():
            for k, v in state.items():
                assert torch.equal(got[key]["state"][pid][k], v), (key, pid, k)


def test_the_guard_leaves_the_thread_at_the_barrier(held, tmp_path):
    saver = _saver()
    model, opt, _ = _setup()
    saver.save(_checkpoint(model, opt), str(tmp_path / "a.ckpt"))
    assert torch._C._len_torch_function_stack() == 1
    held.set()
    saver.wait()
    assert torch._C._len_torch_function_stack() == 0
    with torch.no_grad():
        model[0].weight.mul_(0.5)  # after the barrier nothing is intercepted
    assert saver.stats.guarded == 0


def test_a_failed_copy_is_raised_at_the_barrier_and_leaves_no_file(tmp_path, monkeypatch):
    def broken(dsts, srcs):
        if threading.current_thread().name == "lightning-resume-copy":
            raise RuntimeError("copy failed")
        torch._foreach_copy_(dsts, srcs)

    monkeypatch.setattr(overlap, "_copy_batch", broken)
    saver = _saver(on_error="warn")
    model, opt, _ = _setup()
    saver.save(_checkpoint(model, opt), str(tmp_path / "a.ckpt"))
    saver._copy.join()  # the helper thread failed (else the barrier could copy everything first, and succeed)
    with pytest.raises(RuntimeError, match="copy failed"):
        saver.end_copy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saver.wait()
    assert not (tmp_path / "a.ckpt").exists()


class SideStream(overlap.Devices):
    """CPU tensors stand in for CUDA ones: side-stream copies are queued and run when their event is awaited."""

    def __init__(self):
        self.queued, self.log = [], []
        self._ordered = threading.Lock()  # a stream runs its queued copy once, whole: a second waiter waits for it

    def is_cuda(self, t):
        return True

    def allocate(self, nbytes, pinned):
        return torch.empty(nbytes, dtype=torch.uint8)

    def synchronize(self, device):
        self.log.append("synchronize")

    def copy_on_side_stream(self, dsts, srcs):
        self.log.append(("side", len(dsts)))
        self.queued.append((list(dsts), list(srcs)))
        return len(self.queued) - 1

    def _run(self, event):
        with self._ordered:  # as on a device: a waiter returns only once the copy has ended, whoever ran it
            if self.queued[event] is not None:
                dsts, srcs = self.queued[event]
                torch._foreach_copy_(dsts, srcs)
                self.queued[event] = None

    def wait_event(self, event):
        self.log.append(("wait_event", threading.current_thread() is threading.main_thread()))
        self._run(event)  # the caller's stream is ordered after the copies: they are done before its work

    def synchronize_event(self, event):
        self.log.append(("synchronize_event", threading.current_thread() is threading.main_thread()))
        self._run(event)


def test_cuda_sources_are_copied_on_a_side_stream_and_the_barrier_does_not_block_the_host(tmp_path):
    saver = _saver()
    model, opt, _ = _setup()
    devices = saver.buffers.devices = SideStream()
    expected = _clone(_checkpoint(model, opt))
    saver.save(_checkpoint(model, opt), str(tmp_path / "a.ckpt"))
    assert devices.log[:2] == ["synchronize", ("side", len(saver._copy.names))]  # buffers now, the rest queued
    with torch.no_grad():
        model[0].weight.mul_(0.5)  # the guard orders the edit after the side stream's copy
    assert ("wait_event", True) in devices.log
    saver.end_copy()
    assert ("synchronize_event", True) not in devices.log  # the training thread never waited on the host
    saver.wait()
    _assert_saved(tmp_path / "a.ckpt", expected)


def test_every_save_uses_the_one_copy_thread_of_the_process(tmp_path):
    """No save starts a thread (a new one waits to be scheduled, milliseconds on a loaded machine)."""
    saver = _saver()
    model, opt, x = _setup()
    helper = overlap._HELPER._thread
    assert helper is not None and helper.is_alive()  # started with the saver's optimizer watch
    for i in range(3):
        expected = _clone(_checkpoint(model, opt))
        saver.save(_checkpoint(model, opt), str(tmp_path / f"{i}.ckpt"))
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()  # the barrier
        saver.wait()
        _assert_saved(tmp_path / f"{i}.ckpt", expected)
    assert overlap._HELPER._thread is helper
    assert [t for t in threading.enumerate() if t.name == overlap._Helper.NAME] == [helper]


def test_a_process_without_the_copy_thread_starts_one(tmp_path, monkeypatch):
    """After a fork the child has no copy thread: it is started again (seen here as another pid)."""
    saver = _saver()
    model, opt, _ = _setup()
    before = overlap._HELPER._thread
    monkeypatch.setattr(overlap._HELPER, "_pid", -1)
    expected = _clone(_checkpoint(model, opt))
    saver.save(_checkpoint(model, opt), str(tmp_path / "a.ckpt"))
    saver._copy.join()
    assert overlap._HELPER._thread is not before and overlap._HELPER._thread.is_alive()
    saver.wait()
    _assert_saved(tmp_path / "a.ckpt", expected)


def test_a_view_at_an_offset_into_a_parameter_is_copied_at_the_save(held, tmp_path):
    """Deferred are only tensors that begin where an optimizer-written one does; a slice further in is
    copied at the save (always exact) and holds its value at the save."""
    saver = _saver()
    model, opt, x = _setup()
    ckpt = {**_checkpoint(model, opt), "tail": model[0].weight.detach()[1:]}
    expected = _clone(ckpt)
    saver.save(ckpt, str(tmp_path / "a.ckpt"))
    assert "state_dict.0.weight" in saver._copy.names and "tail" not in saver._copy.names
    held.set()
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    saver.wait()
    got = read.load_file(str(tmp_path / "a.ckpt"), True, None).checkpoint
    assert torch.equal(got["tail"], expected["tail"])
    _assert_saved(tmp_path / "a.ckpt", expected)


@pytest.mark.parametrize("closure", [False, True], ids=["step", "step(closure)"])
def test_two_copies_in_flight_at_once_both_end_at_the_next_step(tmp_path, closure):
    """A durable save and a memory snapshot of the same step, each overlapped: the next optimizer step is the
    barrier of both (one global pre-hook: hooks removed while torch iterates over them broke the step), and the
    guards of both leave the thread."""
    first, second = _saver(), _saver()
    model, opt, x = _setup()
    expected = _clone(_checkpoint(model, opt))
    first.save(_checkpoint(model, opt), str(tmp_path / "a.ckpt"))
    second.save(_checkpoint(model, opt), str(tmp_path / "b.ckpt"))
    copies = [first._copy, second._copy]
    assert all(c is not None and not c.finished for c in copies)

    _next_step(model, opt, x, closure)
    assert all(c is not None and c.finished for c in copies) and not overlap._BARRIERS.copies
    assert torch.overrides._get_current_function_mode() is None  # neither guard is left on the thread
    opt.step()  # no barrier left to run
    first.wait()
    second.wait()
    _assert_saved(tmp_path / "a.ckpt", expected)
    _assert_saved(tmp_path / "b.ckpt", expected)
