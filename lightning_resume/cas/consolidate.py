"""A dedupe checkpoint made self-contained: one file holding every tensor, no references (``consolidate``).

Reads the checkpoint's header once (``format.read.read_summary``), each tensor's bytes from the file or its pack, each
checked against its recorded digest as it is read, and commits them with the checkpoint's own tree text through
``format.write.commit``: the same format, integrity record and atomic commit as any save, only without
``lightning_resume.refs``. The tree is copied as text, never decoded and re-encoded, so the new file loads to the
same checkpoint bit for bit; it starts no lineage (a run resumed from it begins a new one). Holds every tensor in
memory at once, as a load does. Knows files and the format, not Lightning.
"""

from __future__ import annotations

from typing import Dict

import torch

from lightning_resume.cas.check import tensor_bytes
from lightning_resume.errors import ConfigurationError
from lightning_resume.format import framing
from lightning_resume.format.write import commit


def consolidate_file(source: str, out: str) -> Dict[str, int]:
    """Write ``out`` from the dedupe checkpoint ``source``; a summary (tensors, bytes, referenced tensors).
    ``ConfigurationError`` if ``source`` has no references (it is self-contained already)."""
    summary, contents = tensor_bytes(source)
    if not summary.refs.tensors:
        raise ConfigurationError(
            "consolidate", [f"{source} references no blocks: it is a self-contained file already; copy it instead"]
        )
    tensors: Dict[str, torch.Tensor] = {}
    specs = summary.record["tensors"]
    for name, data in contents:
        dtype, shape = framing.DTYPES[specs[name][0]], tuple(specs[name][1])
        raw = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        tensors[name] = raw.view(dtype).reshape(shape)
    commit(out, summary.tree_json, tensors, str(summary.record["algorithm"]))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"tensors": len(tensors), "bytes": nbytes, "referenced": len(summary.refs.tensors)}
