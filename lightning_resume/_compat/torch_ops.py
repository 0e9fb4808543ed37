"""The private torch operators the package relies on (torch 2.13), one function each, with file:line.

Async staging copies many tensors in one call: ``torch._foreach_copy_`` (declared at
``torch/_C/_VariableFunctions.pyi:1847``; the optimizers' multi-tensor path uses it), which does the
per-tensor work in C++ with the GIL released. Ranks that must wait for rank 0 outside any collective meet
on the default process group's key-value store (``distributed_c10d._get_default_store``).
"""

from __future__ import annotations

import contextlib
import operator
from typing import Iterable, Iterator, List

import torch
import torch.distributed as dist


def foreach_copy_(dsts: List[torch.Tensor], srcs: List[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for every pair, in one call (``torch/_C/_VariableFunctions.pyi:1847``)."""
    torch._foreach_copy_(dsts, srcs)


def default_store() -> dist.Store:
    """The default process group's store (``torch/distributed/distributed_c10d.py:1433``):
    the rendezvous ``TCPStore`` every rank reaches, whose waits have their own timeout, not the group's."""
    return dist.distributed_c10d._get_default_store()


def function_mode_on_top(mode: object) -> bool:
    """Whether ``mode`` is the innermost ``TorchFunctionMode`` of this thread, so leaving it pops it and no
    other (``torch/overrides.py:2105`` ``_get_current_function_mode``; the stack is thread-local)."""
    from torch.overrides import _get_current_function_mode

    return _get_current_function_mode() is mode


@contextlib.contextmanager
def without_function_modes() -> Iterator[None]:
    """This thread's ``TorchFunctionMode`` stack set aside for the block and put back as it was after it
    (``torch/overrides.py:2115`` ``_push_mode`` / ``_pop_mode`` over ``torch._C``'s stack functions): tensor
    methods called in it run no mode's Python ``__torch_function__`` (a save's bookkeeping reads the metadata
    of every tensor; under an overlapped copy's guard each read cost a Python call). Tensor subclasses still
    dispatch. A mode must not be entered or left inside the block."""
    stack: List[object] = []
    while torch._C._len_torch_function_stack() > 0:
        stack.append(torch._C._pop_torch_function_stack())
    try:
        yield
    finally:
        for mode in reversed(stack):
            torch._C._push_on_torch_function_stack(mode)


def version(t: torch.Tensor) -> int:
    """The version counter of ``t``'s data (``Tensor._version``, ``torch/_C/__init__.pyi``): every in-place
    write through autograd's dispatch adds one; a ``.detach()`` shares it, a ``.data`` alias does not."""
    return t._version


_VERSION = operator.attrgetter("_version")

NBYTES = operator.attrgetter("nbytes")
"""A tensor's byte count as a C-level getter, for ``sum(map(NBYTES, tensors))`` over thousands of tensors."""


def versions(ts: Iterable[torch.Tensor]) -> List[int]:
    """:func:`version` of each of ``ts``, in one C-level pass (no Python frame per tensor: a save waits for it)."""
    return list(map(_VERSION, ts))
