"""Whether a checkpoint load from a URL may start: the host memory it will hold, against the memory the host
has left and the user's cap. A pure policy: the file's size and format, the bytes in flight, the cap and the
measured memory are passed in (``storage.host_memory`` measures, ``format.read`` asks before it reads the data).
Knows no files, no fsspec, no torch, no Lightning.

A remote file is read through a ``storage.RangedReader``: each tensor lands in its own memory (our format)
or is built by ``torch.load`` from the reader (a ``torch.save`` file), so what the load holds at its peak is
the state it builds plus the reader's chunks in flight and the one being read (``storage.reader_overhead``), which
the caller passes as ``in_flight``. Unknown memory (no ``/proc/meminfo``, no cgroup limit) is no bound: only
the cap, if any, applies.
"""

from __future__ import annotations

import math
from typing import Literal, Mapping, Optional

from lightning_resume.errors import RemoteLoadMemoryError
from lightning_resume.storage.host_memory import Available

Format = Literal["safetensors", "torch.save"]

LOAD_FACTOR: Mapping[Format, float] = {"safetensors": 1.0, "torch.save": 1.0}
"""Host bytes a remote load holds per byte of the file, beside the reader's chunks, measured with
``benchmarks/bench_remote_load.py`` (peak RSS added, fresh interpreter, ``memory://`` and a local S3 server):
1.15-1.18x for both formats at 64 and 256 MB, the chunks in flight (``in_flight``) included."""


def held_bytes(size: int, fmt: Format, in_flight: int) -> int:
    """The host memory a remote load of a ``size``-byte file of ``fmt`` holds at its peak."""
    return math.ceil(size * LOAD_FACTOR[fmt]) + in_flight


def refusal(
    url: str, size: int, fmt: Format, in_flight: int, cap: Optional[int], memory: Optional[Available]
) -> Optional[RemoteLoadMemoryError]:
    """The error to raise before downloading ``url``, or ``None`` if the load fits under ``cap`` and ``memory``."""
    needed = held_bytes(size, fmt, in_flight)
    if cap is not None and needed > cap:
        return RemoteLoadMemoryError(url, size, needed, cap, "remote.max_load_bytes", cap_option=True)
    if memory is not None and needed > memory.nbytes:
        return RemoteLoadMemoryError(url, size, needed, memory.nbytes, memory.where, cap_option=False)
    return None
