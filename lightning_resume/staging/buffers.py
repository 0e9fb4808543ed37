"""Host buffers of async snapshots: one reusable, block-aligned byte pool laid out as a file's data section.

:class:`HostBuffers` copies every tensor of a checkpoint into one preallocated host pool whose views are
the tensors of the file's data section, in file order (pinned, with non-blocking copies and one
synchronisation per device, when a source is on CUDA), so a writer can write it with direct I/O and
nothing the next optimizer step mutates is referenced. :class:`StagedTensors` tells a reader which
tensors are copied yet, so a write may follow the copy tensor by tensor. Small tensors that stay in the
same memory from save to save (the usual case: the same model) are copied by one ``torch.cat`` per run
of them, from byte views kept between saves, so the copy costs no per-tensor work beyond the memcpy. While
the caller encodes a tree in full (long Python work), the last save's tensors can be copied again on a
helper thread (:meth:`HostBuffers.recopy_last`), and that copy is taken for every tensor still the same
memory seen the same way (:meth:`HostBuffers.adopt`). This module knows tensors and memory: no files, no
threads of its own beyond that one copy, no Lightning.
"""

from __future__ import annotations

import itertools
import logging
import operator
import threading
from dataclasses import dataclass
from itertools import compress
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from lightning_resume._compat.torch_ops import foreach_copy_
from lightning_resume.errors import StagingAborted
from lightning_resume.format import framing
from lightning_resume.format.framing import BLOCK

log = logging.getLogger(__name__)

_IS_CUDA = operator.attrgetter("is_cuda")

NOTIFY_BYTES = 8 << 20
"""Copied bytes between two wake-ups of the writer (fewer wake-ups, less contention for the training thread)."""


class Devices:
    """What the pool asks of the accelerator: which sources are on CUDA, page-locked memory, waiting for copies.

    The default is torch's CUDA (one side stream per device for overlapped copies). A subclass can stand in for another accelerator, or, in a test on a machine
    without one, treat CPU tensors as CUDA sources to exercise the pinned, non-blocking path.
    """

    def is_cuda(self, t: torch.Tensor) -> bool:
        return t.is_cuda

    def on_cuda(self, ts: List[torch.Tensor]) -> List[int]:
        """The positions of ``ts`` that :meth:`is_cuda` names: one C-level pass unless a subclass overrides
        :meth:`is_cuda` (a save runs it over every deferred tensor)."""
        test = _IS_CUDA if type(self).is_cuda is Devices.is_cuda else self.is_cuda
        return list(compress(range(len(ts)), map(test, ts)))

    def allocate(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """The pool: page-locked when copies come from CUDA, so they can run as DMA without a bounce buffer."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def copy_on_side_stream(self, dsts: List[torch.Tensor], srcs: List[torch.Tensor]) -> Any:
        """Queue ``dst.copy_(src)`` for each pair on a side stream of the sources' device, after the work queued
        so far on the current stream; the event recorded after them (an overlapped snapshot's CUDA copy).
        The sources are recorded on the side stream, so their memory is not reused before it has read them."""
        device = srcs[0].device
        current = torch.cuda.current_stream(device)
        streams: Dict[torch.device, Any] = self.__dict__.setdefault("_side_streams", {})
        side = streams.get(device)
        if side is None:
            side = streams[device] = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side), torch.no_grad():
            for dst, src in zip(dsts, srcs, strict=True):
                dst.copy_(src, non_blocking=True)
                src.record_stream(side)
            event = torch.cuda.Event()
            event.record(side)
        return event

    def wait_event(self, event: Any) -> None:
        """Order the current stream's later work after ``event`` (the host does not wait)."""
        torch.cuda.current_stream().wait_event(event)

    def synchronize_event(self, event: Any) -> None:
        """Block the calling thread until ``event`` completed."""
        event.synchronize()


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
        placement: Optional[Placement] = None,
    ) -> None:
        super().__init__(views)
        self.image = image
        """The data section as one buffer: the tensors' bytes back to back in file order, start and length
        a multiple of ``BLOCK`` (the tail past the last tensor is padding)."""
        self.placement = placement
        """Where the image and each tensor are in memory (for a writer in another process that maps the pool)."""
        self.writer: Any = None
        """Where the commit runs (``async_save.commit_staged``): ``None`` on the calling thread, or the
        ``writer_process.WriterProcess`` that maps the pool."""
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


_PLACEMENTS = itertools.count(1)


@dataclass(frozen=True)
class Placement:
    """One layout of the pool, as a reader that maps the same memory elsewhere rebuilds it: ``key`` is unique in
    this process, ``pointer`` the address of the image's first byte, ``size`` its length (a multiple of
    ``BLOCK``), ``entries`` each tensor in file order as (name, dtype, shape, begin, end) bytes in the image."""

    key: int
    pointer: int
    size: int
    entries: Tuple[Tuple[str, torch.dtype, Tuple[int, ...], int, int], ...]


@dataclass
class _Layout:
    """The pool carved for one state shape: reused by every save of a state with the same signature."""

    signature: Tuple
    views: Dict[str, torch.Tensor]
    index: Dict[str, int]
    image: memoryview
    names: List[str]
    """The tensors' names in file order (the order of ``views``)."""
    dsts: List[torch.Tensor]
    """``views``' values, in file order."""
    bounds: List[Tuple[int, int]]
    """Each tensor's byte range in the pool, in file order."""
    cuda: bool
    """Whether a source is on an accelerator (then copied by :class:`_Filler`, queued non-blocking)."""
    key: Optional[object] = None
    """The encoder's layout key last found to describe this signature (``codec.TreeText.layout``)."""
    order: Optional[List[int]] = None
    """With ``key``: where each tensor, in file order, is among the values of the mapping given with it."""
    placement: Optional[Placement] = None


def _signature(tensors: Mapping[str, torch.Tensor], is_cuda: Callable[[torch.Tensor], bool]) -> Tuple:
    """What decides the layout and the pool: names, dtypes, shapes, CUDA or not (one tuple; cheap to compare)."""
    return tuple((name, t.dtype, t.shape, is_cuda(t)) for name, t in tensors.items())


class HostBuffers:
    """One host byte pool sized to the state and reused by every save, with its views and layout.

    The pool is allocated on the first save and again only if a later state needs more bytes, or
    needs pinning and the pool is not pinned; ``allocations`` counts that. The views of the pool, the
    file layout and the name index are rebuilt only when the state's signature (names, dtypes,
    shapes) changes, so a save of the same model costs one tuple comparison before the copy, or none when
    the encoder vouches for the signature (``prepare``'s ``key``). From the third save of the same tensors
    on, their copy is one ``torch.cat`` per run of small tensors (:class:`_Sources`).
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
        self._sources: Optional[_Sources] = None
        """The sources of the last CPU-only fill, and their byte views: what :meth:`recopy_last` copies."""
        self.adopted = 0
        """Saves whose copy was made by :meth:`recopy_last` during their encoding (no copy after it)."""
        self.partly_adopted = 0
        """Saves that took the recopy but copied some tensors again after it (those in other memory now)."""

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

    def prepare(self, tensors: Mapping[str, torch.Tensor], key: Optional[object] = None) -> StagedTensors:
        """Views of the pool laid out as the file's data section, in file order, not yet holding their bytes.

        The views of the previous save are reused when the signature is the same (the usual case: the
        same model every time), which keeps their construction off the training thread's clock. ``key``
        (``codec.TreeText.layout``): an object that is the same only for tensors with the same names,
        dtypes, shapes and devices in the same order; when it is the key the layout was last checked
        against, the signature is not computed at all.
        """
        layout = self._layout
        if key is None or layout is None or layout.key is not key:
            signature = _signature(tensors, self.devices.is_cuda)
            if layout is None or layout.signature != signature:
                layout = self._carve(signature, tensors)
            layout.key = key
            position = {name: i for i, name in enumerate(tensors)}
            layout.order = None if key is None else list(map(position.__getitem__, layout.names))
        return StagedTensors(layout.views, layout.image, layout.index, layout.placement)

    def _carve(self, signature: Tuple, tensors: Mapping[str, torch.Tensor]) -> _Layout:
        entries = framing.layout(tensors)
        size = _blocks(entries[-1].end if entries else 0)
        cuda = any(c for *_, c in signature)
        self._ensure(size, pinned=cuda)
        views = {}
        for e in entries:
            t = tensors[e.name]
            views[e.name] = (
                self._pool_bytes(e.end)[e.begin :].view(t.dtype).view(t.shape)
                if e.end > e.begin
                else torch.empty(t.shape, dtype=t.dtype)
            )
        image = memoryview(self._pool_bytes(size).numpy().data)
        names = list(views)
        placement = Placement(
            next(_PLACEMENTS),
            self._pool_bytes(size).data_ptr(),
            size,
            tuple((e.name, tensors[e.name].dtype, tuple(tensors[e.name].shape), e.begin, e.end) for e in entries),
        )
        self._layout = _Layout(
            signature,
            views,
            {name: i for i, name in enumerate(views)},
            image,
            names,
            list(views.values()),
            [(e.begin, e.end) for e in entries],
            cuda,
            placement=placement,
        )
        self._sources = None
        self.layouts += 1
        return self._layout

    def _pool_bytes(self, n: int) -> torch.Tensor:
        assert self._pool is not None
        return self._pool[:n]

    def fill(
        self,
        staged: StagedTensors,
        tensors: Mapping[str, torch.Tensor],
        pointers: Optional[List[int]] = None,
        plain: bool = False,
    ) -> None:
        """Copy ``tensors`` into ``staged`` in file order, releasing each stretch to readers as it is copied.

        CPU tensors are copied in batches of up to ``NOTIFY_BYTES`` with one call each (no Python work
        per tensor beyond a list entry; runs of small tensors in the same memory as the last save's, one
        ``torch.cat`` each); CUDA copies are queued non-blocking and released together after one
        synchronisation per device. If a copy raises, readers get ``StagingAborted`` and the error
        propagates here. ``pointers``: the data pointers of ``tensors``' values in order, when the caller
        has them (``codec.TreeText.pointers``, with the ``key`` :meth:`prepare` was given); ``plain``: the
        caller found every one contiguous CPU memory with no conjugate or negative bit (``TreeText.plain``).
        """
        layout = self._layout
        sources = self._sources
        try:
            with torch.no_grad():
                if layout is None or layout.cuda or sources is None or sources.layout is not layout:
                    self._sources = None
                    filler = _Filler(staged, self.devices)
                    filler.run(tensors)
                    if not filler.sources and layout is not None and not layout.cuda and self._pool is not None:
                        self._sources = _Sources(layout, self._pool, tensors)
                else:
                    sources.refresh(tensors, pointers, plain)
                    sources.copy(staged)
        except BaseException as err:
            self._sources = None
            staged._abort(err)
            raise
        staged._copied_up_to(len(staged), notify=True)

    def recopy_last(self) -> Optional[_Recopy]:
        """Start copying the sources of the last fill into the same places again, on a helper thread.

        Meant to run while the caller encodes the next checkpoint (Python work that holds the GIL; the
        copy is C calls that release it): a model saved again usually has the very same tensors, so
        :meth:`adopt` can then take this copy instead of copying after the encoding. ``None`` when there
        is nothing to recopy (first save, CUDA sources). Worth it only while the encoding is long (a tree
        encoded in full): the copy then competes with little, where a short encoding would gain little and
        share the cores with it. The caller must not touch the pool before :meth:`adopt` (or ``join``) returns.
        """
        sources = self._sources
        if sources is None or sources.layout is not self._layout:
            return None
        return _Recopy(sources)

    def adopt(self, recopy: Optional[_Recopy], staged: StagedTensors, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Wait for ``recopy``; if it copied into the layout of ``staged``, copy again only the tensors it could
        not have copied exactly, mark ``staged`` copied and return ``True``; else ``False`` (the caller then fills).

        Exactly: per tensor, the same memory seen the same way (data pointer, contiguous on the CPU, no
        conjugate or negative bit) as the source the recopy read. The sources of the last fill are kept
        referenced, so a pointer equal to one of theirs cannot be reused memory.
        """
        if recopy is None:
            return False
        recopy.join()
        sources = self._sources
        if not recopy.ok or sources is None or recopy.sources is not sources or sources.layout is not self._layout:
            return False
        try:
            with torch.no_grad():
                moved = sources.refresh(tensors)
                if moved:
                    _copy_batch([sources.layout.dsts[i] for i in moved], [sources.srcs[i] for i in moved])
        except BaseException as err:
            self._sources = None
            staged._abort(err)
            raise
        staged._copied_up_to(len(staged), notify=True)
        if moved:
            self.partly_adopted += 1
        else:
            self.adopted += 1
        return True

    def release(self) -> None:
        self._pool, self._layout, self._sources = None, None, None

    def reserve(self, nbytes: int, pinned: bool = False) -> None:
        """Allocate the pool for a data section of about ``nbytes`` and touch every page of it now.

        Fresh memory costs a page fault per page at first touch; done here, ahead of time and off the
        training thread, the first snapshot blocks for a copy only (a snapshot that needs more than was
        reserved reallocates, as without a reservation)."""
        size = _blocks(nbytes)
        if self._pool is not None and self.capacity >= size and (self.pinned or not pinned):
            return
        self._layout, self._sources = None, None
        self._ensure(size, pinned)
        assert self._pool is not None
        self._pool.zero_()

    def _ensure(self, nbytes: int, pinned: bool) -> None:
        if self._pool is not None and self.capacity >= nbytes and (self.pinned or not pinned):
            return
        # drop the old pool (and every view of it) before allocating the new one: never two at once
        self._pool, self._layout, self._sources = None, None, None
        self._pool = _block_aligned(self.devices.allocate(nbytes + BLOCK, pinned), nbytes)
        self.pinned = pinned
        self.allocations += 1


CAT_MAX_BYTES = 256 << 10
"""Largest tensor a run copy (``torch.cat`` into the pool) takes: smaller ones cost more in per-tensor
overhead than in bytes; larger ones are copied one ``copy_`` each (which may split them across threads)."""

_DATA_PTR = torch.Tensor.data_ptr
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_IS_NEG = torch.Tensor.is_neg
_IS_CONJ = torch.Tensor.is_conj
_IS_CPU = operator.attrgetter("is_cpu")


class _Sources:
    """The sources of the last CPU fill of one layout, in file order, and how to copy them again cheaply.

    They stay referenced, so a data pointer equal to one of theirs is their memory, not memory freed and
    reused. A small source that is plain (contiguous CPU memory, no conjugate or negative bit) and held
    the same memory at two fills in a row gets a 1-D byte view, kept while that holds; each run of such
    views is copied by one ``torch.cat`` into the pool, so the per-tensor cost left is the memcpy's.
    """

    def __init__(self, layout: _Layout, pool: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> None:
        self.layout, self.pool = layout, pool
        self.small = [0 < end - begin <= CAT_MAX_BYTES for begin, end in layout.bounds]
        self.complex = [i for i, t in enumerate(layout.dsts) if t.is_complex()]  # the conj bit exists only there
        self.views: List[Optional[torch.Tensor]] = [None] * len(layout.names)
        self.unviewed = {i for i, small in enumerate(self.small) if small}  # small, without a view yet
        self.srcs: List[torch.Tensor] = []
        self.ptrs: List[int] = []
        self.plain: Optional[List[bool]] = None
        self._take(tensors)
        self._segments: Optional[List[_Segment]] = None

    def _take(
        self, tensors: Mapping[str, torch.Tensor], pointers: Optional[List[int]] = None, plain: bool = False
    ) -> None:
        order = self.layout.order
        if pointers is not None and order is not None and len(pointers) == len(order):
            values = list(tensors.values())
            self.srcs = list(map(values.__getitem__, order))
            self.ptrs = list(map(pointers.__getitem__, order))
            self.plain = None if plain else self._plain(self.srcs)
        else:
            self.srcs = list(map(tensors.__getitem__, self.layout.names))
            self.ptrs = list(map(_DATA_PTR, self.srcs))
            self.plain = self._plain(self.srcs)

    def _plain(self, srcs: List[torch.Tensor]) -> Optional[List[bool]]:
        """``None`` when every source is plain (the usual case, checked in C); else which are."""
        if (
            all(map(_IS_CPU, srcs))
            and all(map(_IS_CONTIGUOUS, srcs))
            and not any(map(_IS_NEG, srcs))
            and not any(_IS_CONJ(srcs[i]) for i in self.complex)
        ):
            return None
        return [t.is_cpu and t.is_contiguous() and not t.is_neg() and not t.is_conj() for t in srcs]

    def refresh(
        self, tensors: Mapping[str, torch.Tensor], pointers: Optional[List[int]] = None, plain: bool = False
    ) -> List[int]:
        """Take ``tensors`` as the sources from now on (``pointers``, ``plain``: as :meth:`HostBuffers.fill`),
        and return the places whose source is not the same plain memory as the last fill's (what a recopy
        of the last fill did not copy exactly)."""
        old_srcs, old_ptrs, old_plain = self.srcs, self.ptrs, self.plain
        self._take(tensors, pointers, plain)
        ptrs, new_plain = self.ptrs, self.plain
        if old_plain is None and new_plain is None:  # the usual case: every source plain, then and now
            moved = [] if ptrs == old_ptrs else list(compress(range(len(ptrs)), map(operator.ne, ptrs, old_ptrs)))
        else:  # a strided, conjugate or negative source is the same only if seen the same way
            same = list(map(operator.eq, ptrs, old_ptrs))
            for i in range(len(same)):
                if same[i] and not (_flag(old_plain, i) and _flag(new_plain, i)):
                    same[i] = _same_view(old_srcs[i], self.srcs[i])
            moved = list(compress(range(len(same)), map(operator.not_, same)))
        views, unviewed = self.views, self.unviewed
        for i in moved:
            if views[i] is not None:  # a view of the old memory: drop it (and the memory it holds)
                views[i] = None
                self._segments = None
        if unviewed:  # small, without a view: one if plain in the same memory two fills in a row
            still = set(moved)
            for i in [i for i in unviewed if i not in still and _flag(new_plain, i)]:
                unviewed.discard(i)
                try:
                    views[i] = self.srcs[i].view(-1).view(torch.uint8)
                except RuntimeError as err:  # not seen as bytes after all: stays copied source by source
                    log.debug("no byte view of tensor %s: %s", self.layout.names[i], err)
                self._segments = None
        unviewed.update(i for i in moved if self.small[i])
        return moved

    def segments(self) -> List[_Segment]:
        """The copy in file order: runs of views (one ``torch.cat`` each) and batches of the other sources,
        each at most ``NOTIFY_BYTES`` unless one tensor is larger."""
        if self._segments is None:
            segments: List[_Segment] = []
            bounds, views = self.layout.bounds, self.views
            start, nbytes = 0, 0
            for i in range(len(views) + 1):
                if i == len(views) or (
                    i > start and ((views[i] is None) != (views[start] is None) or nbytes >= NOTIFY_BYTES)
                ):
                    if i > start:
                        run = [v for v in views[start:i] if v is not None] if views[start] is not None else None
                        out = self.pool[bounds[start][0] : bounds[i - 1][1]] if run is not None else None
                        segments.append(_Segment(start, i, nbytes, run, out))
                    start, nbytes = i, 0
                if i < len(views):
                    nbytes += bounds[i][1] - bounds[i][0]
            self._segments = segments
        return self._segments

    def copy(self, staged: StagedTensors) -> None:
        """Copy the current sources into ``staged`` in file order, releasing each stretch to readers."""
        dsts, srcs = self.layout.dsts, self.srcs
        unreleased = 0
        for seg in self.segments():
            _copy_segment(seg, dsts, srcs)
            unreleased += seg.nbytes
            notify = unreleased >= NOTIFY_BYTES
            staged._copied_up_to(seg.end, notify)
            unreleased = 0 if notify else unreleased

    def recopy(self) -> None:
        """:meth:`copy` again from the same sources, releasing nothing (:meth:`HostBuffers.adopt` does)."""
        dsts, srcs = self.layout.dsts, self.srcs
        for seg in self.segments():
            _copy_segment(seg, dsts, srcs)


def _flag(flags: Optional[List[bool]], i: int) -> bool:
    return flags is None or flags[i]


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same CPU memory seen the same way (a copy of either gives the same bytes)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.stride() == b.stride()
        and a.is_conj() == b.is_conj()
        and a.is_neg() == b.is_neg()
        and a.is_cpu
        and b.is_cpu
    )


@dataclass(frozen=True)
class _Segment:
    """Places ``[start, end)`` of a layout: a run of byte views copied into ``out`` by one ``torch.cat``, or
    (``views`` ``None``) a batch copied source by source."""

    start: int
    end: int
    nbytes: int
    views: Optional[List[torch.Tensor]]
    out: Optional[torch.Tensor]


def _copy_segment(seg: _Segment, dsts: List[torch.Tensor], srcs: List[torch.Tensor]) -> None:
    if seg.views is not None:
        try:
            torch.cat(seg.views, out=seg.out)
            return
        except RuntimeError as err:  # e.g. a source overlapping the pool: copy it the general way
            log.debug("run copy of tensors %d-%d failed, copying them one by one: %s", seg.start, seg.end, err)
    _copy_batch(dsts[seg.start : seg.end], srcs[seg.start : seg.end])


class _Filler:
    """One :meth:`HostBuffers.fill` of a new layout or of CUDA sources: batches of CPU copies, queued CUDA
    copies, in-order release."""

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


class _Recopy:
    """:meth:`HostBuffers.recopy_last` in flight: the last fill's copy again, on a helper thread."""

    def __init__(self, sources: _Sources) -> None:
        self.sources, self.ok = sources, False
        self._thread = threading.Thread(target=self._run, name="lightning-resume-recopy")
        self._thread.start()

    def _run(self) -> None:
        try:
            with torch.no_grad():
                self.sources.recopy()
            self.ok = True
        except BaseException as err:  # noqa: BLE001 - the caller then copies the usual way
            log.debug("recopy of the last snapshot failed, copying after encoding instead: %s", err)

    def join(self) -> None:
        self._thread.join()


def _copy_batch(dsts: List[torch.Tensor], srcs: List[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair; many pairs in one call (the per-tensor cost is then in C++)."""
    if len(dsts) == 1:
        dsts[0].copy_(srcs[0])
    elif dsts:
        foreach_copy_(dsts, srcs)


def _blocks(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def _block_aligned(raw: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The ``nbytes`` of ``raw`` (allocated ``BLOCK`` bytes larger) that start on a ``BLOCK`` boundary."""
    skip = -raw.data_ptr() % BLOCK
    return raw[skip : skip + nbytes]
