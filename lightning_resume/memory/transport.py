"""Moving a committed memory-tier file from one rank to another, in bounded chunks, over a group of its own.

A transfer is a fixed-size header (magic, byte count, chunk size, a small record such as the snapshot's save
sequence and step), then the file's bytes in chunks of at most :data:`CHUNK`. The sender maps the committed
file and hands each chunk's pages to the group straight from the mapping (no copy); the receiver receives
each chunk into one reused buffer and gives it to a sink (e.g. ``MemoryStore.write_received``) before
receiving the next, so memory stays bounded by one chunk per direction whatever the file's size. A sender
with nothing to send sends a header of zero bytes ("nothing"), so both sides always complete a pair of calls,
and a sink that stops early (the file would not fit) still leaves the stream in step: the rest is drained.

The transfers run on a gloo group made for them (:func:`transfer_group`), apart from the training's own
group: the bytes live in host memory (tmpfs), where gloo sends them as they are, while NCCL would need them
copied to the GPU first and would share its streams with training's collectives. Knows ``torch.distributed``
and files, not Lightning.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar, Union

import torch
import torch.distributed as dist

from lightning_resume.errors import ReplicaTransferError

T = TypeVar("T")

CHUNK = 64 << 20
"""Most bytes per message: the receiver's buffer, and what a transfer holds in memory beyond the files."""

MAGIC = 0x4C52_5245_504C_4943  # "LRREPLIC"
"""First word of every header: a stream out of step shows here, not as a corrupted file."""

RECORD_WORDS = 4
"""Integers of the sender's record that travel in the header (e.g. save sequence and step)."""

HEADER_WORDS = 3 + RECORD_WORDS
"""magic, byte count, chunk size, record."""

FILE_TAG = 7
"""Tag of a transfer's messages: other point-to-point traffic on the group (acknowledgements) uses others."""

IDLE_TIMEOUT = timedelta(hours=24)
"""How long a receive on the transfer group may wait: a receiver waits for the next snapshot between saves,
which may be far apart. A peer that ends closes its connection, which ends the wait at once."""

BREAK_TAG = 0x4C52
"""Tag nothing is ever sent with: :func:`break_group` waits on it to close the group's connections."""

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

_broken: list[tuple[Any, torch.Tensor]] = []  # groups cut by break_group, with the buffer gloo still points at


def transfer_group(timeout: timedelta = IDLE_TIMEOUT) -> Any:
    """A gloo process group over every rank, for transfers only. Collective: every rank calls it, in the same
    order relative to the job's other group creations (at setup). Gloo, not NCCL, even on GPUs: the files are
    in host memory, which gloo sends as they are; NCCL would need a copy to the device and would compete with
    training's own collectives on its streams."""
    return dist.new_group(backend="gloo", timeout=timeout)


def send_file(
    path: Union[str, int, None],
    dst: int,
    group: Any,
    chunk_bytes: int = CHUNK,
    record: Sequence[int] = (),
    tag: int = FILE_TAG,
) -> int:
    """Send the file at ``path`` (or the file open as descriptor ``path``, left open) to rank ``dst``; the bytes
    sent. ``None``: send "nothing" (a header of zero bytes). ``record``: up to :data:`RECORD_WORDS` integers
    the receiver finds in ``chunks.record``. Blocks until the receiver has taken every chunk."""
    if not 0 < chunk_bytes <= CHUNK:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be in 1..{CHUNK}")
    if path is None:
        _send_header(0, chunk_bytes, record, dst, group, tag)
        return 0
    fd = path if isinstance(path, int) else os.open(path, _READ_FLAGS)
    try:
        return _send_open(fd, dst, group, chunk_bytes, record, tag)
    finally:
        if not isinstance(path, int):
            os.close(fd)


def send_nothing(dst: int, group: Any, tag: int = FILE_TAG) -> None:
    """Tell rank ``dst`` there is nothing to send: its :func:`recv_file` returns ``None``."""
    send_file(None, dst, group, tag=tag)


def _send_open(fd: int, dst: int, group: Any, chunk_bytes: int, record: Sequence[int], tag: int) -> int:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
        raise ValueError(f"descriptor {fd} is not a regular file with bytes in it")
    nbytes = st.st_size
    # A private mapping is writable as far as Python knows (torch.frombuffer wants that), shares the file's pages
    # until written, and is never written: the chunks go out of the page cache without a copy.
    mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        data = torch.frombuffer(mapped, dtype=torch.uint8)
        _send_header(nbytes, chunk_bytes, record, dst, group, tag)
        start = 0
        try:
            for start in range(0, nbytes, chunk_bytes):
                dist.send(data[start : start + chunk_bytes], dst, group=group, tag=tag)
        except RuntimeError as err:
            raise ReplicaTransferError(dst, f"sending stopped at byte {start} of {nbytes}: {err}") from err
        finally:
            del data
    finally:
        with contextlib.suppress(BufferError):  # a view still held by an error's traceback: freed with it
            mapped.close()
    return nbytes


def _send_header(nbytes: int, chunk_bytes: int, record: Sequence[int], dst: int, group: Any, tag: int) -> None:
    if len(record) > RECORD_WORDS:
        raise ValueError(f"a record holds at most {RECORD_WORDS} integers, not {len(record)}")
    words = [MAGIC, nbytes, chunk_bytes, *record] + [0] * (RECORD_WORDS - len(record))
    try:
        dist.send(torch.tensor(words, dtype=torch.int64), dst, group=group, tag=tag)
    except RuntimeError as err:
        raise ReplicaTransferError(dst, f"the header could not be sent: {err}") from err


class Chunks(Iterator[memoryview]):
    """The chunks of one transfer, in order, each valid until the next is asked for (one reused buffer);
    ``record``: the sender's record, ``nbytes``: the file's size. Whatever a sink leaves unread is drained."""

    def __init__(
        self,
        src: int,
        group: Any,
        tag: int,
        nbytes: int,
        chunk_bytes: int,
        record: tuple[int, ...],
        buffer: Optional[torch.Tensor],
    ) -> None:
        self.src, self.group, self.tag = src, group, tag
        self.nbytes, self.chunk_bytes, self.record = nbytes, chunk_bytes, record
        size = min(chunk_bytes, nbytes)
        usable = buffer is not None and buffer.dtype == torch.uint8 and buffer.numel() >= size
        self.buffer: torch.Tensor = buffer if buffer is not None and usable else torch.empty(size, dtype=torch.uint8)
        self.received = 0

    def __next__(self) -> memoryview:
        if self.received >= self.nbytes:
            raise StopIteration
        n = min(self.chunk_bytes, self.nbytes - self.received)
        view = self.buffer[:n]
        try:
            dist.recv(view, self.src, group=self.group, tag=self.tag)
        except RuntimeError as err:
            what = f"the stream ended at byte {self.received} of {self.nbytes}: {err}"
            raise ReplicaTransferError(self.src, what) from err
        self.received += n
        return memoryview(view.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers

    def drain(self) -> None:
        for _ in self:
            pass


def recv_file(
    src: int,
    group: Any,
    sink: Callable[[int, Iterator[memoryview]], T],
    buffer: Optional[torch.Tensor] = None,
    tag: int = FILE_TAG,
) -> Optional[T]:
    """Receive one transfer from rank ``src``: ``sink(nbytes, chunks)``'s result, or ``None`` when the sender
    said "nothing". ``chunks`` is a :class:`Chunks` (its ``record`` is the sender's); what the sink does not
    read is received and dropped, so the stream stays in step even when the sink refuses or raises. ``buffer``:
    a uint8 tensor to receive into (reused across calls), at least the sender's chunk size; else one is made.
    ``ReplicaTransferError`` when the stream is out of step or the peer ends mid-transfer."""
    header = torch.zeros(HEADER_WORDS, dtype=torch.int64)
    try:
        dist.recv(header, src, group=group, tag=tag)
    except RuntimeError as err:
        raise ReplicaTransferError(src, f"no header came: {err}") from err
    magic, nbytes, chunk_bytes, *record = (int(w) for w in header.tolist())
    if magic != MAGIC:
        raise ReplicaTransferError(src, f"the header's first word is {magic:#x}, not {MAGIC:#x}: out of step")
    if nbytes == 0:
        return None
    if nbytes < 0 or not 0 < chunk_bytes <= CHUNK:
        raise ReplicaTransferError(src, f"the header announces {nbytes} bytes in chunks of {chunk_bytes}")
    chunks = Chunks(src, group, tag, nbytes, chunk_bytes, tuple(record), buffer)
    try:
        result = sink(nbytes, chunks)
    except ReplicaTransferError:
        raise  # the stream itself failed: nothing more comes
    except BaseException:
        chunks.drain()  # the sink's error: the next transfer's header is still where the sender expects it
        raise
    chunks.drain()
    return result


def break_group(group: Any) -> None:
    """Close ``group``'s connections now, so that every send and receive waiting on it, here and on its peers,
    fails at once ("Application timeout caused pair closure" here, "Connection closed by peer" there). For an
    end that cannot wait for the peers' last word: a thread still waiting in gloo when the interpreter exits
    is woken during finalization when a peer ends, and aborts the process. The group is unusable afterwards;
    the job's other groups are untouched. Gloo closes a context whose receive times out; this makes one time
    out at once, on a tag nothing is sent with."""
    if group is None or dist.get_world_size(group) < 2:
        return
    peer = (dist.get_rank(group) + 1) % dist.get_world_size(group)
    dummy = torch.zeros(1, dtype=torch.uint8)
    _broken.append((group, dummy))  # gloo keeps a pointer to the buffer of the receive it gave up
    work = dist.irecv(dummy, peer, group=group, tag=BREAK_TAG)
    try:
        if work is not None:  # None only on a rank outside the group
            work.wait(timedelta(milliseconds=1))
    except RuntimeError:
        return  # the timeout: the group is closed
