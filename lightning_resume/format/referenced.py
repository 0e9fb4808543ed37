"""Reading the tensors a content-addressed checkpoint references: each block from its pack, checked as it arrives.

A checkpoint's refs record (``format.packs``) names, for each referenced tensor, a pack in ``<D>/blocks/`` and the
block's key there. :class:`Packs` opens each pack once per load (a local file read with plain reads or mapped
copy-on-write; a remote one by ranged reads of the blocks needed), checks its header, and finds the block. Every
problem is a ``CheckpointCorruptError`` on the checkpoint that names the tensor, the pack's path and the key: a
missing pack, a block the pack lacks or of another size, a digest that differs from the key. This module knows files
and tensors, not which tensors were referenced (``cas``) or Lightning.
"""

from __future__ import annotations

import mmap as mmap_module
import os
import stat
from typing import Any, Dict, List, Optional, Tuple

import torch

from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.format import framing, integrity, packs
from lightning_resume.format.packs import Ref, Refs
from lightning_resume.storage import files as storage
from lightning_resume.storage.deadline import Deadline
from lightning_resume.storage.files import is_local, local_path

CHUNK = 1 << 18
"""Bytes read and hashed at a time (as ``read.CHUNK``)."""


def where(path: str, ref: Ref) -> str:
    """How an error names a referenced tensor: the tensor, its pack's path and its key."""
    return f"tensor '{ref.name}' (pack {packs.pack_path(path, ref.pack)}, key {ref.key})"


class Packs:
    """The packs one load of the checkpoint ``path`` reads, each opened once; close them with :meth:`close`."""

    def __init__(self, path: str, deadline: Optional[Deadline] = None) -> None:
        self.path, self._deadline = path, deadline
        self._open: Dict[str, Tuple[framing.Header, Any, int]] = {}  # pack name -> (header, file or None, size)
        self._maps: Dict[str, Any] = {}  # pack name -> its copy-on-write map (kept alive by the tensors' views)

    def __enter__(self) -> Packs:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for _, f, _ in self._open.values():
            if f is not None:
                f.close()
        self._open.clear()

    def entry(self, ref: Ref) -> framing.Entry:
        """The block ``ref`` names in its pack, checked to exist and to have the tensor's size."""
        header = self._pack(ref)[0]
        e = header.entries.get(ref.key)
        if e is None:
            raise CheckpointCorruptError(self.path, f"{where(self.path, ref)}: the pack has no such block")
        if e.end - e.begin != ref.nbytes:
            raise CheckpointCorruptError(
                self.path, f"{where(self.path, ref)}: block size differs from the tensor's", ref.nbytes, e.end - e.begin
            )
        return framing.Entry(ref.name, ref.dtype, ref.shape, header.data_start + e.begin, header.data_start + e.end)

    def read_into(self, ref: Ref, into: memoryview, check: Optional[integrity.DataCheck], reuse: bool = False) -> None:
        """Read the block of ``ref`` into ``into`` (or, with ``reuse``, chunk by chunk into its start), hashing each
        chunk into ``check``; the digest is compared when the block ends."""
        e = self.entry(ref)
        _, f, _ = self._pack(ref)
        for start in range(e.begin, e.end, CHUNK):
            n = min(CHUNK, e.end - start)
            chunk = into[:n] if reuse else into[start - e.begin : start - e.begin + n]
            self._read(ref, f, start, chunk)
            if check is not None:
                check.update(chunk)
        if check is not None:
            check.end_tensor(e, where(self.path, ref))

    def mapped(self, ref: Ref) -> Tuple[Any, framing.Entry]:
        """A copy-on-write map of the (local) pack of ``ref`` and the block's entry in it (offsets in the map)."""
        e = self.entry(ref)
        _, f, _ = self._pack(ref)
        if ref.pack not in self._maps:
            self._maps[ref.pack] = mmap_module.mmap(f.fileno(), 0, access=mmap_module.ACCESS_COPY)
        return self._maps[ref.pack], e

    def _pack(self, ref: Ref) -> Tuple[framing.Header, Any, int]:
        if ref.pack not in self._open:
            self._open[ref.pack] = self._open_pack(ref)
        return self._open[ref.pack]

    def _open_pack(self, ref: Ref) -> Tuple[framing.Header, Any, int]:
        p = packs.pack_path(self.path, ref.pack)
        try:
            if is_local(p):
                if not stat.S_ISREG(os.stat(local_path(p)).st_mode):  # a FIFO would block the open forever
                    raise CheckpointCorruptError(self.path, f"{where(self.path, ref)}: the pack is not a regular file")
                f: Any = open(local_path(p), "rb", buffering=0)  # noqa: SIM115 - kept open for the load, closed by close()
                size = os.fstat(f.fileno()).st_size
                head = os.pread(f.fileno(), 9, 0)
            else:
                f, remote_size = None, storage.size(p, self._deadline)
                if remote_size is None:
                    raise FileNotFoundError(p)
                size = remote_size
                head = storage.read_range(p, 0, 9, self._deadline)
        except FileNotFoundError as err:
            raise CheckpointCorruptError(self.path, f"{where(self.path, ref)}: the pack is missing") from err
        try:
            n = framing.header_length(p, head, size)
            rest = os.pread(f.fileno(), n - 1, 9) if f is not None else storage.read_range(p, 9, 8 + n, self._deadline)
            header = framing.parse_header(p, head + rest, size)
            packs.parse_pack(p, header)
        except CheckpointCorruptError as err:
            if f is not None:
                f.close()
            raise CheckpointCorruptError(self.path, f"{where(self.path, ref)}: the pack is damaged: {err}") from err
        return header, f, size

    def _read(self, ref: Ref, f: Any, offset: int, into: memoryview) -> None:
        if f is None:
            data = storage.read_range(packs.pack_path(self.path, ref.pack), offset, offset + len(into), self._deadline)
            got = len(data)
            into[:got] = data
        else:
            got = os.preadv(f.fileno(), [into], offset)
            while 0 < got < len(into):
                k = os.preadv(f.fileno(), [into[got:]], offset + got)
                got = got + k if k else got
                if not k:
                    break
        if got != len(into):
            raise CheckpointCorruptError(
                self.path, f"{where(self.path, ref)}: the pack ended while reading (truncated?)", len(into), got
            )


def read_referenced(
    path: str,
    refs: Refs,
    order: List[str],
    check: Optional[integrity.DataCheck],
    targets: Optional[Dict[str, torch.Tensor]] = None,
    written: Optional[List[str]] = None,
    deadline: Optional[Deadline] = None,
) -> Dict[str, torch.Tensor]:
    """Each referenced tensor, in ``order`` (the integrity record's), read into new memory or its destination in
    ``targets`` (appended to ``written`` as its read begins), hashed into ``check``."""
    tensors: Dict[str, torch.Tensor] = {}
    with Packs(path, deadline) as opened:
        for name in order:
            ref = refs.tensors[name]
            t = (targets or {}).get(name)
            if t is None:
                opened.entry(ref)  # the block exists with the tensor's size: a record's shape allocates nothing else
                t = torch.empty(ref.shape, dtype=framing.DTYPES[ref.dtype])
            elif written is not None:
                written.append(name)
            opened.read_into(ref, framing.host_bytes(t), check)
            tensors[name] = t
    return tensors


def verify_referenced(path: str, refs: Refs, order: List[str], check: integrity.DataCheck) -> None:
    """Hash every referenced block into ``check`` holding one chunk at a time (``read.verify_open``)."""
    scratch = memoryview(bytearray(CHUNK))
    with Packs(path) as opened:
        for name in order:
            opened.read_into(refs.tensors[name], scratch, check, reuse=True)
