"""Overlapped snapshot copies: what only the optimizer step writes is copied while the next step computes.

An overlapped save (``async_save.AsyncSaver`` with ``overlapped``; ``SafetensorsCheckpointIO(save="overlapped")``) copies on the caller's thread only the
tensors that something other than an optimizer step may change (buffers a forward updates, such as
BatchNorm statistics; frozen parameters; every other tensor of the checkpoint), and defers the ones an
optimizer step writes (its parameters and its state, found by :class:`OptimizerWatch`) to a copy that runs
on a helper thread (CPU; torch's copy kernels release the GIL) or on a side CUDA stream, while the next
forward and backward run. The copy must be over before anything writes those tensors, so:

* the **barrier** (:meth:`OverlappedCopy.finish`) runs before the next optimizer step of any optimizer in
  the process (``torch.optim``'s global step pre-hook; a step given a closure, as Lightning's automatic
  optimization and ``GradScaler`` do, waits after the closure, so the copy still overlaps the forward and
  backward the closure runs), and before the next save, ``wait`` and ``close``;
* until then an in-place write through torch's Python API (``p.mul_()``, ``p.data.copy_()``,
  ``p[...] = x``, ``torch._foreach_*_``, ``out=``) to a tensor not copied yet first copies it on the
  caller's thread (:class:`_CopyOnWrite`, a ``TorchFunctionMode`` on that thread only): an EMA-style
  callback that edits weights between the save and the next step is saved with the values it had at
  the save, and counted (``guarded``);
* at the barrier each deferred tensor's version counter (``tensor._version``) is compared with its value
  at the save: one that changed before its copy ended, by a write the guard did not see (C++ code,
  code run with torch functions disabled), is copied again, synchronously, counted (``recopied``) and
  warned about: its bytes are then its value at the barrier, not at the save.

The writer reads a deferred tensor only after the barrier, so it never reads bytes a recopy rewrites.
The save's own part is kept to a few C-level passes over the tensors: the split compares data pointers
(``map`` over the tensors, no Python frame per tensor), and the copies run on one helper thread kept for
the process (:class:`_Helper`): starting a thread per save made the caller wait until the new thread was
scheduled, milliseconds on a loaded machine. Knows tensors, threads and accelerators; no files, no Lightning.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import queue
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from itertools import chain, compress, repeat
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode

from lightning_resume._compat.torch_ops import NBYTES, function_mode_on_top, version, versions
from lightning_resume.errors import AsyncWriteWarning
from lightning_resume.staging.buffers import NOTIFY_BYTES, Devices, StagedTensors, _copy_batch

log = logging.getLogger(__name__)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


_DATA_PTR = torch.Tensor.data_ptr
_NUMEL = torch.Tensor.numel
_VALUES = operator.methodcaller("values")


class OptimizerWatch:
    """The optimizers that stepped in this process (weakly held), and the memory their steps write.

    One ``torch.optim`` global step post-hook, installed while a watch is open; an optimizer is known from
    its first step on, so a save before any step defers nothing (everything is copied at the save). A watch
    also starts the process's copy thread (:class:`_Helper`), so that no save waits for a thread to start.
    """

    def __init__(self) -> None:
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        ref = weakref.ref(self)

        def seen(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            watch = ref()
            if watch is not None:
                watch.optimizers.add(optimizer)

        self._handle = register_optimizer_step_post_hook(seen)
        weakref.finalize(self, self._handle.remove)
        _HELPER.ensure()

    def written_pointers(self) -> Set[int]:
        """Where the tensors an optimizer step writes begin: every known optimizer's parameters and state
        tensors (their data pointers; computed at each save, so a parameter moved or a state replaced is seen)."""
        out: Set[int] = set()
        for opt in list(self.optimizers):
            for group in opt.param_groups:
                out.update(map(_DATA_PTR, group["params"]))
            values = list(chain.from_iterable(map(_VALUES, opt.state.values())))  # C-level passes: thousands
            out.update(map(_DATA_PTR, compress(values, map(isinstance, values, repeat(torch.Tensor)))))
        out.discard(0)  # where empty tensors begin: nothing is written there
        return out

    def split(self, staged: StagedTensors, tensors: Dict[str, torch.Tensor]) -> Tuple[List[int], List[int]]:
        """The positions in ``staged`` (file order) of the tensors to copy now and of those to defer: deferred
        are the non-empty ones that begin where a tensor an optimizer step writes begins (its parameter or
        state seen through another tensor object, as ``state_dict`` gives it), and only those. A view at an
        offset into such memory is copied at the save: copying early is always exact, deferring needs the
        barrier to cover every write."""
        written = self.written_pointers()
        if not written:
            return list(range(len(staged))), []
        srcs = list(map(tensors.__getitem__, staged))
        later = list(map(operator.and_, map(bool, map(_NUMEL, srcs)), map(written.__contains__, map(_DATA_PTR, srcs))))
        places = range(len(srcs))
        return list(compress(places, map(operator.not_, later))), list(compress(places, later))


def copy_now(dsts: List[torch.Tensor], srcs: List[torch.Tensor], devices: Devices) -> None:
    """Copy each pair on the caller's thread (CUDA sources queued non-blocking, one synchronisation per device)."""
    cuda = devices.on_cuda(srcs)
    synchronize = {srcs[i].device for i in cuda}
    with torch.no_grad():
        for i in cuda:
            dsts[i].copy_(srcs[i], non_blocking=True)
        if cuda:
            taken = set(cuda)
            dsts = [d for i, d in enumerate(dsts) if i not in taken]
            srcs = [t for i, t in enumerate(srcs) if i not in taken]
        _copy_batch(dsts, srcs)
    for device in synchronize:
        devices.synchronize(device)


@dataclass
class CopyStats:
    """One overlapped snapshot's copy, as the metrics report it."""

    deferred_bytes: int = 0
    """Bytes copied after the save returned (while training went on)."""
    sync_bytes: int = 0
    """Bytes copied at the save, on the caller's thread."""
    barrier_seconds: float = 0.0
    """Caller's time blocked at the barrier, waiting for the deferred copy (and any recopy)."""
    guarded: int = 0
    """In-place writes the copy-on-write guard held until their tensors were copied (by it, or by the helper
    thread it waited for): each saved as it was at the save."""
    recopied: List[str] = field(default_factory=list)
    """Tensors copied again at the barrier: changed, unseen by the guard, before their copy ended."""


_PENDING, _CLAIMED, _DONE = 0, 1, 2


class OverlappedCopy:
    """One snapshot's deferred copy: started by :meth:`start`, ended by :meth:`finish` (the barrier).

    ``places``: the positions, in file order, of the deferred tensors among ``staged``'s; every other
    tensor of ``staged`` must hold its bytes already.
    """

    def __init__(
        self,
        staged: StagedTensors,
        sources: Sequence[torch.Tensor],
        places: Sequence[int],
        devices: Devices,
    ) -> None:
        names = list(staged)
        self.staged, self.devices = staged, devices
        self.names = [names[i] for i in places]
        self.dsts = [staged[n] for n in self.names]
        self.srcs = list(sources)
        self.cuda = devices.on_cuda(self.srcs)  # positions on a GPU
        self._on_gpu = set(self.cuda)
        self.state = [_PENDING] * len(self.srcs)
        self.versions = versions(self.srcs)
        self.after_copy: List[Optional[int]] = [None] * len(self.srcs)
        self._by_storage: Optional[Dict[int, List[int]]] = None  # built at the first write the guard sees
        self.stats = CopyStats(deferred_bytes=sum(map(NBYTES, self.dsts)))
        self._cv = threading.Condition()
        self._error: Optional[BaseException] = None
        self._ran: Optional[threading.Event] = None  # set once the helper thread's part is over
        self._event: Any = None
        self._owner = threading.get_ident()
        self._guard: Optional[_CopyOnWrite] = None
        self.finished = False
        self.on_end: Optional[Callable[[CopyStats], None]] = None
        """Called with the stats once the barrier passed."""
        self.after_barrier: Optional[Callable[[], None]] = None
        """Called once the barrier is over, passed or failed (the saver hands the write to its worker then)."""
        self._copied = self._passed = self._released = False
        self._ordered: Set[int] = set()  # CUDA sources whose writes the guard queued after the side copy

    # ---- the copy --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the copy: CUDA sources are queued on a side stream first, the caller's thread is guarded and
        the next optimizer step hooked, then the helper thread is handed the CPU copies (it takes them without
        the caller waiting for it)."""
        cuda = self.cuda
        if cuda:
            self._event = self.devices.copy_on_side_stream([self.dsts[i] for i in cuda], [self.srcs[i] for i in cuda])
        self._guard = _CopyOnWrite(self)
        self._guard.__enter__()
        _BARRIERS.add(self)
        self._ran = threading.Event()
        _HELPER.submit(lambda: self._run(self._on_gpu))

    def _run(self, cuda: Set[int]) -> None:
        try:
            start = 0
            while start < len(self.srcs):
                batch = self._claim(start, cuda)
                if batch:
                    with torch.no_grad():
                        _copy_batch([self.dsts[i] for i in batch], [self.srcs[i] for i in batch])
                    self._done(batch)
                start = batch[-1] + 1 if batch else len(self.srcs)
            if self._event is not None:
                self.devices.synchronize_event(self._event)  # the queued CUDA copies are over
                self._done(sorted(cuda), versions=[self.versions[i] for i in sorted(cuda)])
        except BaseException as err:  # noqa: BLE001 - the barrier raises it on the caller's thread
            with self._cv:
                self._error = err
                self._cv.notify_all()
        self._release(copied=True)
        assert self._ran is not None
        self._ran.set()

    def _claim(self, start: int, cuda: Set[int]) -> List[int]:
        """The next pending CPU tensors from ``start`` (up to ``NOTIFY_BYTES``), claimed for the helper thread."""
        batch: List[int] = []
        nbytes = 0
        with self._cv:
            for i in range(start, len(self.srcs)):
                if self.state[i] != _PENDING or i in cuda:
                    if batch:
                        break
                    continue
                self.state[i] = _CLAIMED
                batch.append(i)
                nbytes += self.dsts[i].numel() * self.dsts[i].element_size()
                if nbytes >= NOTIFY_BYTES:
                    break
        return batch

    def _done(self, batch: List[int], versions: Optional[List[int]] = None) -> None:
        """Mark ``batch`` copied, with the version each source had once its copy ended (``versions``: a
        CUDA copy reads what its stream ordered, so the versions at the save)."""
        after = versions if versions is not None else [version(self.srcs[i]) for i in batch]
        with self._cv:
            for i, v in zip(batch, after, strict=True):
                self.state[i] = _DONE
                self.after_copy[i] = v
            self._cv.notify_all()

    def _release(self, copied: bool = False, barrier: bool = False) -> None:
        """Hand every tensor to the writer once both the copy and the barrier are over (whichever is last)."""
        with self._cv:
            self._copied = self._copied or copied
            self._passed = self._passed or barrier
            ready = self._copied and self._passed and self._error is None and not self._released
            self._released = self._released or ready
            error = self._error if self._copied and self._passed else None
        if ready:
            self.staged._copied_up_to(len(self.staged), notify=True)
        elif error is not None:
            self.staged._abort(error)

    # ---- the guard -------------------------------------------------------------------------------

    def by_storage(self) -> Dict[int, List[int]]:
        """The deferred positions by the storage their source lives in (a source's storage is the one it had at
        the save: the saved tensors are the state's own detached objects, which nothing rebinds)."""
        if self._by_storage is None:
            self._by_storage = {}
            for i, t in enumerate(self.srcs):
                self._by_storage.setdefault(_storage(t), []).append(i)
        return self._by_storage

    def before_write(self, targets: Sequence[Any]) -> None:
        """Called by the guard before an in-place write to ``targets``: copy those not copied yet, now."""
        hit: List[int] = []
        for t in targets:
            if isinstance(t, torch.Tensor):
                hit += self.by_storage().get(_storage(t), ())
        if not hit:
            return
        mine: List[int] = []
        with self._cv:
            met = any(self.state[i] != _DONE for i in hit)
            for i in hit:
                if self.state[i] == _PENDING:
                    self.state[i] = _CLAIMED
                    mine.append(i)
        self.stats.guarded += met
        if mine:
            if self._event is not None and any(self.devices.is_cuda(self.srcs[i]) for i in mine):
                self.devices.wait_event(self._event)  # the write is queued after the side stream's copies
            with torch.no_grad():
                _copy_batch([self.dsts[i] for i in mine], [self.srcs[i] for i in mine])
            self._done(mine)
        cuda = [i for i in hit if self.devices.is_cuda(self.srcs[i])]
        if cuda:
            self.devices.wait_event(self._event)
            self._ordered.update(cuda)
        with self._cv:  # those the helper thread is copying: the write waits for that copy
            while any(self.state[i] != _DONE for i in hit) and self._error is None:
                self._cv.wait()

    # ---- the barrier -----------------------------------------------------------------------------

    def finish(self) -> CopyStats:
        """The barrier: wait for the CPU copies (the caller's CUDA stream, not the host, waits for the CUDA
        ones), copy again what changed unseen, hand the tensors to the writer once copied; unguard.

        Idempotent. Raises the copy's error (the writer then gets ``StagingAborted``)."""
        if self.finished:
            return self.stats
        self.finished = True
        started = time.monotonic()
        try:
            self._unguard()
            if self._event is not None:
                self.devices.wait_event(self._event)
            on_gpu = self._on_gpu
            cpu = [i for i in range(len(self.srcs)) if i not in on_gpu] if on_gpu else range(len(self.srcs))
            with self._cv:  # what the helper thread has not claimed yet is copied here, alongside it
                mine = [i for i in cpu if self.state[i] == _PENDING] if _PENDING in self.state else []
                for i in mine:
                    self.state[i] = _CLAIMED
            if mine:
                with torch.no_grad():
                    _copy_batch([self.dsts[i] for i in mine], [self.srcs[i] for i in mine])
                self._done(mine)
            with self._cv:
                while self._error is None and self._copying(cpu):
                    self._cv.wait()
                error = self._error
            if error is not None:
                raise error
            self._recopy_changed()
        except BaseException as err:
            with self._cv:
                self._error = self._error or err
            self._release(barrier=True)
            raise
        finally:
            self.stats.barrier_seconds = time.monotonic() - started
            if self.after_barrier is not None:
                self.after_barrier()
        self._release(barrier=True)
        if self.on_end is not None:
            self.on_end(self.stats)
        return self.stats

    def _copying(self, cpu: Sequence[int]) -> bool:
        """Whether a CPU tensor is not copied yet (with no CUDA source: one C-level count, not a frame per tensor)."""
        if not self._on_gpu:
            return self.state.count(_DONE) != len(self.state)
        return any(self.state[i] != _DONE for i in cpu)

    def join(self) -> None:
        """Until the helper thread's part is done (the CUDA copies included): for tests and teardown."""
        if self._ran is not None:
            self._ran.wait()

    def _recopy_changed(self) -> None:
        now = versions(self.srcs)
        if now == self.versions:  # nothing written since the save (a version counter only grows): the usual case
            return
        on_gpu = self._on_gpu
        changed = [
            i
            for i, v in enumerate(now)
            if v != self.versions[i]
            and (i not in self._ordered if i in on_gpu else self.after_copy[i] != self.versions[i])
        ]
        if not changed:
            return
        cuda = {self.srcs[i].device for i in changed if self.devices.is_cuda(self.srcs[i])}
        if cuda:
            self.join()  # the side stream's copy is over before the same bytes are written again
        with torch.no_grad():
            _copy_batch([self.dsts[i] for i in changed], [self.srcs[i] for i in changed])
        for device in cuda:
            self.devices.synchronize(device)
        names = [self.names[i] for i in changed]
        self.stats.recopied += names
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        warnings.warn(
            f"overlapped snapshot: {shown} changed in place between the save and the next optimizer step through"
            " a path the copy-on-write guard does not see (C++ code, torch functions disabled); copied again, so"
            " the checkpoint holds its value at that optimizer step, not at the save, and a resume from it is not"
            " exact for these tensors. Make that change through torch's Python API, or save with save='async'.",
            AsyncWriteWarning,
            stacklevel=4,
        )

    def _unguard(self) -> None:
        _BARRIERS.discard(self)
        guard, self._guard = self._guard, None
        if guard is None:
            return
        guard.copy = None  # a guard that cannot be popped here passes everything through from now on
        if threading.get_ident() == self._owner and function_mode_on_top(guard):
            guard.__exit__(None, None, None)
        else:
            _STRANDED.append((self._owner, guard))
        pop_stranded()


class _Barriers:
    """The process's one global optimizer step pre-hook: the barrier of every overlapped copy in flight.

    Installed at the first copy and kept: a hook that removed itself while ``torch.optim`` iterates over the
    global hooks (two copies in flight at once, a durable save's and a memory snapshot's) would change that
    dict under the iteration. A step given a closure (Lightning's automatic optimization, ``GradScaler``) runs
    the barriers after the closure, so the copies still overlap the forward and backward the closure runs.
    """

    def __init__(self) -> None:
        self.copies: List[OverlappedCopy] = []
        self._installed = False

    def add(self, copy: OverlappedCopy) -> None:
        if not self._installed:
            register_optimizer_step_pre_hook(self._before_step)
            self._installed = True
        self.copies.append(copy)

    def discard(self, copy: OverlappedCopy) -> None:
        with contextlib.suppress(ValueError):
            self.copies.remove(copy)

    def _before_step(self, optimizer: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        copies = list(self.copies)
        if not copies:
            return None
        if "closure" in kwargs and kwargs["closure"] is not None:
            return args, {**kwargs, "closure": _then_finish(kwargs["closure"], copies)}
        if len(args) > 1 and args[1] is not None:
            return (args[0], _then_finish(args[1], copies), *args[2:]), kwargs
        _finish_all(copies)
        return None


def _finish_all(copies: Sequence[OverlappedCopy]) -> None:
    """Every barrier runs, the first error raised once they all did."""
    error: Optional[BaseException] = None
    for copy in copies:
        try:
            copy.finish()
        except BaseException as err:  # noqa: BLE001 - raised below, after the other copies' barriers
            error = error or err
    if error is not None:
        raise error


def _then_finish(closure: Any, copies: Sequence[OverlappedCopy]) -> Any:
    def closure_then_barrier() -> Any:
        result = closure()
        _finish_all(copies)
        return result

    return closure_then_barrier


_BARRIERS = _Barriers()


class _Helper:
    """The process's copy thread: runs the deferred copies handed to it, one after another, in order.

    Kept for the process (a daemon, at the priority of the thread that started it: the training thread's,
    since the copy must end before the next optimizer step). Started again after a ``fork`` (a child has no
    threads but the one that forked). A copy's function handles its own errors; one that still raises is
    logged, and the thread goes on with the next.
    """

    NAME = "lightning-resume-copy"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._pid = 0

    def ensure(self) -> None:
        """Start the thread unless it runs in this process already."""
        if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
            return
        with self._lock:
            if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
                return
            self._jobs = queue.SimpleQueue()  # after a fork: what the parent queued is not this process's
            self._thread = threading.Thread(target=self._loop, args=(self._jobs,), name=self.NAME, daemon=True)
            self._pid = os.getpid()
            self._thread.start()

    def submit(self, run: Callable[[], None]) -> None:
        """Queue ``run`` on the thread (started first if needed); returns at once."""
        self.ensure()
        self._jobs.put(run)

    @staticmethod
    def _loop(jobs: queue.SimpleQueue[Callable[[], None]]) -> None:
        while True:
            run = jobs.get()
            try:
                run()
            except Exception:  # the next copy must still run (a thread that died is started again)
                log.exception("lightning-resume: an overlapped snapshot copy failed outside its own handling")


_HELPER = _Helper()


_STRANDED: List[Tuple[int, TorchFunctionMode]] = []
"""Guards a barrier on another thread (or under another mode) could not pop: popped on their own thread later."""


def pop_stranded() -> None:
    """Pop the disarmed guards of this thread that are on top of its mode stack (innermost first)."""
    me = threading.get_ident()
    for owner, guard in reversed(list(_STRANDED)):
        if owner == me and function_mode_on_top(guard):
            guard.__exit__(None, None, None)
            _STRANDED.remove((owner, guard))


_WRITE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                            "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                            "__imatmul__"})  # fmt: skip
_METADATA_ONLY = frozenset({"requires_grad_", "detach_", "rename_"})
"""In-place by name, but they change a tensor's autograd or naming metadata, never its bytes. Attribute
setters (``p.grad = None``, as every ``zero_grad`` does; ``p.data = x``, which rebinds the parameter and
leaves the saved memory as it was) are not writes either: guarding them made the next step's ``zero_grad``
wait for the whole deferred copy on the training thread."""


class _CopyOnWrite(TorchFunctionMode):
    """On the saving thread until the barrier: before an in-place write, copy its target if it is deferred."""

    def __init__(self, copy: OverlappedCopy) -> None:
        super().__init__()
        self.copy: Optional[OverlappedCopy] = copy

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        copy = self.copy
        if copy is not None:
            targets = _written(func, args, kwargs)
            if targets:
                copy.before_write(targets)
        return func(*args, **kwargs)


def _written(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> List[Any]:
    """The tensors ``func(*args, **kwargs)`` writes in place (an in-place method, ``_foreach_*_``, ``out=``)."""
    out: List[Any] = []
    name = getattr(func, "__name__", "")
    in_place = name.endswith("_") and not name.endswith("__") and name not in _METADATA_ONLY
    if args and (in_place or name in _WRITE_DUNDERS):
        first = args[0]
        out += list(first) if isinstance(first, (list, tuple)) else [first]
    given = kwargs.get("out")
    if given is not None:
        out += list(given) if isinstance(given, (list, tuple)) else [given]
    return out
