"""Host buffers of async snapshots: one reusable, block-aligned byte pool laid out as a file's data section.

:class:`HostBuffers` copies every tensor of a checkpoint into one preallocated host pool whose views are
the tensors of the file's data section, in file order (pinned, with non-blocking copies and one
synchronisation per device, when a source is on CUDA), so a writer can write it with direct I/O and
nothing the next optimizer step mutates is referenced. :class:`StagedTensors` tells a reader which
tensors are copied yet, so a write may follow the copy tensor by tensor. A save of the same tensors as
the last one (the usual case) can be copied on a helper thread while the caller encodes the tree
(:meth:`HostBuffers.recopy_last`), and is taken only if every tensor is still the same memory seen the
same way (:meth:`HostBuffers.adopt`). This module knows tensors and memory: no files, no threads of its
own beyond that one copy, no Lightning.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch

from lightning_resume._compat.torch_ops import foreach_copy_
from lightning_resume.errors import StagingAborted
from lightning_resume.io import framing
from lightning_resume.io.framing import BLOCK

log = logging.getLogger(__name__)

NOTIFY_BYTES = 8 << 20
"""Copied bytes between two wake-ups of the writer (fewer wake-ups, less contention for the training thread)."""


class Devices:
    """What the pool asks of the accelerator: which sources are on CUDA, page-locked memory, waiting for copies.

    The default is torch's CUDA. A subclass can stand in for another accelerator, or, in a test on a machine
    without one, treat CPU tensors as CUDA sources to exercise the pinned, non-blocking path.
    """

    def is_cuda(self, t: torch.Tensor) -> bool:
        return t.is_cuda

    def allocate(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """The pool: page-locked when copies come from CUDA, so they can run as DMA without a bounce buffer."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)


class StagedTensors(Dict[str, torch.Tensor]):
    """One snapshot's host copies, by name, in file order; filled in that order by :meth:`HostBuffers.fill`.

    The views exist before their bytes do: a reader (the background write) calls :meth:`wait` for each
    tensor before touching it, so the write of the first tensors overlaps the copy of the later ones.
    """

    def __init__(
        self,
        views: Dict[str, torch.Tensor],
        image: Optional[memoryview] = None,
        index: Optional[Dict[str, int]] = None,
    ) -> None:
        super().__init__(views)
        self.image = image
        """The data section as one buffer: the tensors' bytes back to back in file order, start and length
        a multiple of ``BLOCK`` (the tail past the last tensor is padding)."""
        self._index = index if index is not None else {name: i for i, name in enumerate(views)}
        self._copied = 0  # tensors [0, _copied) hold their bytes; only the filling thread writes it
        self._error: Optional[BaseException] = None
        self._cv = threading.Condition()

    def wait(self, name: str) -> None:
        """Block until ``self[name]`` holds its bytes; ``StagingAborted`` if the copy failed first."""
        i = self._index[name]
        if self._copied > i:
            return
        with self._cv:
            while self._copied <= i and self._error is None:
                self._cv.wait()
            if self._copied <= i:
                raise StagingAborted(f"the snapshot copy failed before tensor '{name}' was copied") from self._error

    def _copied_up_to(self, count: int, notify: bool) -> None:
        self._copied = count
        if notify:
            with self._cv:
                self._cv.notify_all()

    def _abort(self, error: BaseException) -> None:
        with self._cv:
            self._error = error
            self._cv.notify_all()


@dataclass(frozen=True)
class _Layout:
    """The pool carved for one state shape: reused by every save of a state with the same signature."""

    signature: Tuple
    views: Dict[str, torch.Tensor]
    index: Dict[str, int]
    image: memoryview


def _signature(tensors: Mapping[str, torch.Tensor], is_cuda: Callable[[torch.Tensor], bool]) -> Tuple:
    """What decides the layout and the pool: names, dtypes, shapes, CUDA or not (one tuple; cheap to compare)."""
    return tuple((name, t.dtype, t.shape, is_cuda(t)) for name, t in tensors.items())


class HostBuffers:
    """One host byte pool sized to the state and reused by every save, with its views and layout.

    The pool is allocated on the first save and again only if a later state needs more bytes, or
    needs pinning and the pool is not pinned; ``allocations`` counts that. The views of the pool, the
    file layout and the name index are rebuilt only when the state's signature (names, dtypes,
    shapes) changes, so a save of the same model costs one tuple comparison before the copy.
    ``devices``: how sources on an accelerator are recognised, pinned memory allocated and copies awaited.
    """

    def __init__(self, devices: Optional[Devices] = None) -> None:
        self.devices = devices if devices is not None else Devices()
        self._pool: Optional[torch.Tensor] = None
        self.pinned = False
        self.allocations = 0
        self.layouts = 0
        """How many times views were carved (first save, and each save whose signature changed)."""
        self._layout: Optional[_Layout] = None
        self._last: Optional[Tuple[_Layout, List[torch.Tensor], List[torch.Tensor]]] = None
        """The layout, destinations and sources of the last CPU-only fill: what :meth:`recopy_last` copies."""
        self.adopted = 0
        """Saves whose copy was made by :meth:`recopy_last` during their encoding (no copy after it)."""

    @property
    def capacity(self) -> int:
        return 0 if self._pool is None else self._pool.numel()

    def stage(self, tensors: Mapping[str, torch.Tensor]) -> StagedTensors:
        """Copy ``tensors`` into the pool and return them as contiguous CPU views of it.

        The views stay valid until the next ``stage`` or ``release``; the caller must not stage again
        while a writer still reads them.
        """
        staged = self.prepare(tensors)
        self.fill(staged, tensors)
        return staged

    def prepare(self, tensors: Mapping[str, torch.Tensor]) -> StagedTensors:
        """Views of the pool laid out as the file's data section, in file order, not yet holding their bytes.

        The views of the previous save are reused when the signature is the same (the usual case: the
        same model every time), which keeps their construction off the training thread's clock.
        """
        signature = _signature(tensors, self.devices.is_cuda)
        layout = self._layout
        if layout is None or layout.signature != signature:
            layout = self._carve(signature, tensors)
        return StagedTensors(layout.views, layout.image, layout.index)

    def _carve(self, signature: Tuple, tensors: Mapping[str, torch.Tensor]) -> _Layout:
        entries = framing.layout(tensors)
        size = _blocks(entries[-1].end if entries else 0)
        self._ensure(size, pinned=any(cuda for *_, cuda in signature))
        views = {}
        for e in entries:
            t = tensors[e.name]
            views[e.name] = (
                self._pool_bytes(e.end)[e.begin :].view(t.dtype).view(t.shape)
                if e.end > e.begin
                else torch.empty(t.shape, dtype=t.dtype)
            )
        image = memoryview(self._pool_bytes(size).numpy().data)
        self._layout = _Layout(signature, views, {name: i for i, name in enumerate(views)}, image)
        self.layouts += 1
        return self._layout

    def _pool_bytes(self, n: int) -> torch.Tensor:
        assert self._pool is not None
        return self._pool[:n]

    def fill(self, staged: StagedTensors, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy ``tensors`` into ``staged`` in file order, releasing each stretch to readers as it is copied.

        CPU tensors are copied in batches of up to ``NOTIFY_BYTES`` with one call each (no Python work
        per tensor beyond a list entry); CUDA copies are queued non-blocking and released together
        after one synchronisation per device. If a copy raises, readers get ``StagingAborted`` and the
        error propagates here.
        """
        self._last = None
        try:
            with torch.no_grad():
                filler = _Filler(staged, self.devices)
                filler.run(tensors)
        except BaseException as err:
            staged._abort(err)
            raise
        staged._copied_up_to(len(staged), notify=True)
        if not filler.sources and self._layout is not None:
            self._last = (self._layout, list(staged.values()), [tensors[name] for name in staged])

    def recopy_last(self) -> Optional[_Recopy]:
        """Start copying the sources of the last fill into the same places again, on a helper thread.

        Meant to run while the caller encodes the next checkpoint (Python work that holds the GIL; the
        copy is one C call that releases it): a model saved again usually has the very same tensors, so
        :meth:`adopt` can then take this copy instead of copying after the encoding. ``None`` when there
        is nothing to recopy (first save, CUDA sources). The caller must not touch the pool before
        :meth:`adopt` (or ``join``) returns.
        """
        return None if self._last is None else _Recopy(*self._last)

    def adopt(self, recopy: Optional[_Recopy], staged: StagedTensors, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Wait for ``recopy``; if it copied exactly what :meth:`fill` of ``tensors`` would, mark ``staged``
        copied and return ``True``; else ``False`` (the caller then fills).

        Exactly: the same layout object (same names, dtypes, shapes) and, per tensor, the same memory
        seen the same way (data pointer, strides, conjugate and negative bits). The sources of the last
        fill are kept referenced, so a pointer equal to one of theirs cannot be reused memory.
        """
        if recopy is None:
            return False
        recopy.join()
        if not recopy.ok or recopy.layout is not self._layout or len(tensors) != len(recopy.srcs):
            return False
        for old, name in zip(recopy.srcs, staged, strict=True):
            new = tensors[name]
            if not _same_view(old, new):
                return False
        staged._copied_up_to(len(staged), notify=True)
        self.adopted += 1
        return True

    def release(self) -> None:
        self._pool, self._layout, self._last = None, None, None

    def reserve(self, nbytes: int, pinned: bool = False) -> None:
        """Allocate the pool for a data section of about ``nbytes`` and touch every page of it now.

        Fresh memory costs a page fault per page at first touch; done here, ahead of time and off the
        training thread, the first snapshot blocks for a copy only (a snapshot that needs more than was
        reserved reallocates, as without a reservation)."""
        size = _blocks(nbytes)
        if self._pool is not None and self.capacity >= size and (self.pinned or not pinned):
            return
        self._layout = None
        self._ensure(size, pinned)
        assert self._pool is not None
        self._pool.zero_()

    def _ensure(self, nbytes: int, pinned: bool) -> None:
        if self._pool is not None and self.capacity >= nbytes and (self.pinned or not pinned):
            return
        self._pool, self._layout = None, None  # drop the old pool before allocating the new one: never two at once
        self._pool = _block_aligned(self.devices.allocate(nbytes + BLOCK, pinned), nbytes)
        self.pinned = pinned
        self.allocations += 1


class _Filler:
    """One :meth:`HostBuffers.fill`: batches of CPU copies, queued CUDA copies, in-order release."""

    def __init__(self, staged: StagedTensors, devices: Devices) -> None:
        self.staged, self.api = staged, devices
        self.limit = NOTIFY_BYTES
        self.dsts: List[torch.Tensor] = []  # the batch: copied together by one call
        self.srcs: List[torch.Tensor] = []
        self.batched = 0  # bytes in the batch
        self.unreleased = 0  # bytes copied since readers were last woken
        self.sources: set = set()  # the devices of CUDA sources

    def run(self, tensors: Mapping[str, torch.Tensor]) -> None:
        is_cuda = self.api.is_cuda
        for i, (name, dst) in enumerate(self.staged.items()):  # file order
            t = tensors[name]
            if is_cuda(t):
                self.flush(i)
                dst.copy_(t, non_blocking=True)
                self.sources.add(t.device)
                continue
            self.dsts.append(dst)
            self.srcs.append(t)
            nbytes = t.numel() * t.element_size()
            self.batched += nbytes
            self.unreleased += nbytes
            if self.batched >= self.limit:
                self.flush(i + 1)
        self.flush(len(self.staged))
        for device in self.sources:  # one synchronisation per device, after every copy was queued
            self.api.synchronize(device)

    def flush(self, copied: int) -> None:
        """Copy the batch; release tensors ``[0, copied)`` unless a CUDA copy is still queued."""
        if self.dsts:
            _copy_batch(self.dsts, self.srcs)
            self.dsts, self.srcs, self.batched = [], [], 0
        if not self.sources:  # released in order: nothing after a queued CUDA copy until the sync
            notify = self.unreleased >= NOTIFY_BYTES
            self.staged._copied_up_to(copied, notify)
            self.unreleased = 0 if notify else self.unreleased


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.stride() == b.stride()
        and a.is_conj() == b.is_conj()
        and a.is_neg() == b.is_neg()
        and not b.is_cuda
    )


class _Recopy:
    """:meth:`HostBuffers.recopy_last` in flight: one batched copy on a helper thread."""

    def __init__(self, layout: _Layout, dsts: List[torch.Tensor], srcs: List[torch.Tensor]) -> None:
        self.layout, self.srcs, self.ok = layout, srcs, False
        self._thread = threading.Thread(target=self._run, args=(dsts, srcs), name="lightning-resume-recopy")
        self._thread.start()

    def _run(self, dsts: List[torch.Tensor], srcs: List[torch.Tensor]) -> None:
        try:
            with torch.no_grad():
                _copy_batch(dsts, srcs)
            self.ok = True
        except BaseException as err:  # noqa: BLE001 - the caller then copies the usual way
            log.debug("recopy of the last snapshot failed, copying after encoding instead: %s", err)

    def join(self) -> None:
        self._thread.join()


def _copy_batch(dsts: List[torch.Tensor], srcs: List[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair; many pairs in one call (the per-tensor cost is then in C++)."""
    if len(dsts) == 1:
        dsts[0].copy_(srcs[0])
    else:
        foreach_copy_(dsts, srcs)


def _blocks(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def _block_aligned(raw: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The ``nbytes`` of ``raw`` (allocated ``BLOCK`` bytes larger) that start on a ``BLOCK`` boundary."""
    skip = -raw.data_ptr() % BLOCK
    return raw[skip : skip + nbytes]
