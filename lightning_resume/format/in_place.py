"""Which tensors of a checkpoint a load may read straight into memory its caller already holds.

A resume builds the module, then loads a checkpoint whose tensors replace the module's own. Reading them
into new memory and copying them over costs a second copy of the weights and, on a VM, faulting in pages
never touched before: at 1 GB that was most of the time to the first resumed step here
(``benchmarks/RESULTS.md``, "time to first step"). ``plan`` pairs each tensor of the file with a destination
the caller offers, by its place in the checkpoint's tree (for Lightning ``("state_dict", name)``), when the
destination can take the file's bytes as they are: a dense, contiguous CPU tensor of the same dtype and
shape, whose memory no other destination of another tensor overlaps. ``overwritten_error`` words a load that failed
after it had written into some of them. Pure: no files, no reading.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from lightning_resume.errors import CheckpointCorruptError, PartialLoadError
from lightning_resume.format.framing import DTYPES, Entry

TreePath = Tuple[str, ...]
"""Keys from the root of a checkpoint's tree to a tensor, e.g. ``("state_dict", "layer.weight")``."""

MAPPING_TAGS = frozenset({"dict", "odict"})
"""Tree nodes whose string keys a path walks (``format.codec``'s encoding of ``dict`` and ``OrderedDict``)."""


def plan(tree: Any, entries: Mapping[str, Entry], offered: Mapping[TreePath, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The file's tensor key -> the offered destination its bytes are read into, for each one that fits.

    A destination that does not fit (another dtype, shape or device, not contiguous, a tensor subclass such
    as a ``DTensor``, nothing at that path in the file) is left out: that tensor loads into new memory as
    before. So are destinations whose memory overlaps another's of a different tensor (a model that ties two
    weights the file holds apart): filling both would leave whichever came last, where a load into the
    module copies them in its own order."""
    chosen: Dict[str, torch.Tensor] = {}
    for where, t in offered.items():
        key = tensor_key(tree, where)
        if key is not None and key not in chosen and key in entries and fits(entries[key], t):
            chosen[key] = t  # a tensor the file stores once for two places (tied weights) fills the first
    return _without_overlaps(chosen)


def tensor_key(tree: Any, where: TreePath) -> Optional[str]:
    """The key of the tensor at ``where`` in a parsed tree, or ``None`` if no tensor is there."""
    node = tree
    for name in where:
        if not (isinstance(node, dict) and node.get("@") in MAPPING_TAGS and isinstance(node.get("v"), dict)):
            return None
        node = node["v"].get(name)
    if isinstance(node, dict) and node.get("@") == "tensor" and isinstance(node.get("k"), str):
        return node["k"]
    return None


def fits(entry: Entry, t: torch.Tensor) -> bool:
    """``t`` can take ``entry``'s bytes in place: a plain dense CPU tensor, contiguous, same dtype and shape."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout == torch.strided
        and t.device.type == "cpu"
        and not t.is_conj()
        and not t.is_neg()
        and t.is_contiguous()
        and DTYPES.get(entry.dtype) == t.dtype
        and tuple(t.shape) == tuple(entry.shape)
        and entry.end > entry.begin
    )


def _without_overlaps(chosen: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``chosen`` without the destinations whose memory overlaps another's (each overlap marks both)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), key) for key, t in chosen.items())
    clash: set = set()
    reach, reaching = -1, ""  # the furthest end so far, and whose
    for begin, end, key in spans:
        if begin < reach:
            clash |= {key, reaching}
        if end > reach:
            reach, reaching = end, key
    return {key: t for key, t in chosen.items() if key not in clash}


def overwritten_error(err: Exception, path: str, overwritten: int, owner: str) -> Exception:
    """The error to raise for ``err``, a load of ``path`` that failed after it had read ``overwritten`` tensors into
    destinations of ``owner`` (e.g. "the module Net"): a checksum failure stays a ``CheckpointCorruptError`` (the
    "last" fallback catches it), any other failure becomes a ``PartialLoadError``; both say how many and what
    to do, and carry the count as ``overwritten_in_place``."""
    note = (
        f"{overwritten} tensor(s) of {owner} were read in place before the failure and hold this file's bytes:"
        " load a checkpoint that verifies into them (the fallback of ckpt_path='last' does) or build the model"
        " again before using it; a fit on it in this process is refused until then, unless you call"
        " lightning_resume.accept_partial(module)"
    )
    if isinstance(err, CheckpointCorruptError):
        said = CheckpointCorruptError(err.path, f"{err.what}; {note}", err.expected, err.actual)
        said.overwritten_in_place = overwritten
        return said
    return PartialLoadError(path, f"{path}: {type(err).__name__}: {err}; {note}", overwritten)
