"""One copy for two snapshots of the same state at the same point: the second reads the first's staged bytes.

At the step of a durable save, ``ExactResume``'s memory tier takes its snapshot right after it, of the same
weights and optimizer state. A saver that lends (``async_save.AsyncSaver.lend_staging``) keeps an
:class:`Offer` of its newest snapshot: its staged tensors, the source tensors they were copied from, and
each source's version counter at the save. The saver of the second snapshot takes from the offer every
tensor whose source is the same memory (data pointer, dtype, shape, strides, device, conjugate and negative
bits) and whose version counter has not moved since the first save (no in-place write through autograd's
dispatch: every optimizer step moves it); it copies its other tensors itself. Its write then reads the
lender's pool (:class:`BorrowedStaged`), so the lender waits for that write before its next save reuses the
pool and before it gives the pool back (``Offer.borrowers``).

The caller decides that the offer is of this very point (``ExactResume`` takes it only when the durable save
made it at the same step boundary): a write between the two dumps that bypasses version counters (a
``.data`` alias) is then only code run by the checkpoint hooks themselves. Knows tensors, not files or
Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from lightning_resume._compat.torch_ops import version
from lightning_resume.staging.buffers import StagedTensors
from lightning_resume.threads import Job


def _key(t: torch.Tensor) -> Tuple[Any, ...]:
    """What makes two tensors the same bytes when one's version counter has not moved: the same memory,
    read the same way."""
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device, t.is_conj(), t.is_neg())


@dataclass
class Offer:
    """A lender's newest snapshot, as another saver may take from it (see the module docstring)."""

    staged: StagedTensors
    sources: Dict[str, torch.Tensor]
    """The tensors the snapshot copied, by its names (the lender's own references, not copies)."""
    versions: List[int]
    """Each source's version counter at the save, in ``sources``' order."""
    end_copy: Callable[[], Any]
    """The lender's barrier (``overlapped``): a borrower that waits for its write ends the lender's copy first."""
    when_copied: Callable[[Callable[[], None]], None]
    """Runs a callback once the lender's copy is over (at its barrier, or at once): a borrower hands its write to
    its worker then, so the write's start does not take the GIL from the training thread before it."""
    borrowers: List[Job] = field(default_factory=list)
    """The writes reading ``staged``: the lender waits for them before it reuses or frees its pool."""

    def match(self, tensors: Mapping[str, torch.Tensor]) -> Dict[str, str]:
        """Which of ``tensors`` the offer holds the bytes of: their names, each to the offer's name for it.
        Empty tensors are never taken (they all begin at address 0)."""
        held: Dict[Tuple[Any, ...], str] = {}
        for (name, src), before in zip(self.sources.items(), self.versions, strict=True):
            if src.numel() and version(src) == before:
                held.setdefault(_key(src), name)
        if not held:
            return {}
        out: Dict[str, str] = {}
        for name, t in tensors.items():
            if t.numel():
                lent = held.get(_key(t))
                if lent is not None:
                    out[name] = lent
        return out


@dataclass(frozen=True)
class Lending:
    """A lender's side of the loan, for the saver that borrows: how the lender copies, and its newest offer."""

    overlapped: bool
    """Whether the lender's saves copy the optimizer-stepped state while the next step runs (``staging.overlap``);
    the borrower's saves then copy the same way, so both snapshots hold the same point."""
    newest: Callable[[], Optional[Offer]]
    """The lender's newest snapshot (``None`` before its first save)."""


class BorrowedStaged(StagedTensors):
    """A snapshot's staged tensors, some in its own pool (copied by its saver) and some in a lender's.

    ``wait`` on a borrowed name waits for the lender's copy of it (an overlapped copy ends at the lender's
    barrier). There is no single image of the data section, so the file is written from the views (no
    direct I/O from a pool), and no placement: a writer process could not map two pools.
    """

    def __init__(self, own: StagedTensors, lent: StagedTensors, taken: Dict[str, str]) -> None:
        views = {name: lent[taken[name]] if name in taken else view for name, view in own.items()}
        super().__init__(views)
        self._lent, self._taken = lent, taken

    def wait(self, name: str) -> None:
        lent = self._taken.get(name)
        if lent is not None:
            self._lent.wait(lent)
        else:
            super().wait(name)

    @property
    def borrowed_bytes(self) -> int:
        return sum(self[name].nbytes for name in self._taken)
