"""The private torch operators the package relies on (torch 2.13), one function each, with file:line.

Async staging copies many tensors in one call: ``torch._foreach_copy_`` (declared at
``torch/_C/_VariableFunctions.pyi:1847``; the optimizers' multi-tensor path uses it), which does the
per-tensor work in C++ with the GIL released.
"""

from __future__ import annotations

from typing import List

import torch


def foreach_copy_(dsts: List[torch.Tensor], srcs: List[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for every pair, in one call (``torch/_C/_VariableFunctions.pyi:1847``)."""
    torch._foreach_copy_(dsts, srcs)
