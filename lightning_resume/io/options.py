"""The typed option groups of ``SafetensorsCheckpointIO``: when a save copies, where it writes, remote limits.

Plain values and one frozen dataclass, so that LightningCLI (jsonargparse) builds each from YAML. Each
validates itself and returns every problem at once; the plugin raises them together. Knows no files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Literal, Optional

from lightning_resume.durations import Duration, parse_duration
from lightning_resume.errors import ConfigurationError
from lightning_resume.staging.async_save import WriterKind
from lightning_resume.storage import multipart

__all__ = ["DEFAULT_REMOTE", "SAVE_MODES", "WRITERS", "RemoteOptions", "SaveMode", "WriterKind"]

SaveMode = Literal["sync", "async", "overlapped"]
"""When a save copies the state, and so how long it blocks training.

``"sync"``: the save writes the file and returns once it is durable (no copy). ``"async"``: the save copies
the state into host buffers and returns; the write runs in the background. ``"overlapped"``: as ``"async"``,
but the save copies only what the next forward may change; the weights and optimizer state are copied
while the next forward and backward run, before the next optimizer step."""

SAVE_MODES = ("sync", "async", "overlapped")

WRITERS = ("thread", "process")
"""The values of ``WriterKind`` (``staging.async_save``): where the write and its hashing run: ``"thread"``, in
the training process (a worker thread, or the training thread for a ``"sync"`` save); ``"process"``, in a
writer process of its own."""


@dataclass(frozen=True)
class RemoteOptions:
    """Limits of loads from and uploads to object stores (``s3://``...). Local files are unaffected.

    Args:
        max_load_bytes: the most host memory, in bytes, one load from a URL may hold. Such a load streams
            the file into the tensors' own memory (about 1.0x its size, for both formats).
            ``None`` (default): no cap. Either way a load that would need more than the host (or its cgroup)
            has left is refused with ``RemoteLoadMemoryError`` before anything is downloaded.
        upload_part_size: bytes of one part of a multi-part upload (at least 5 MiB; default 16 MiB).
        upload_concurrency: most parts in flight at once (default 8). An upload holds at most
            ``upload_part_size * upload_concurrency`` bytes beside the state.
        read_deadline: the longest one load from a URL may take, every request and every retry included
            (ours, s3fs's and botocore's). Seconds, a ``timedelta`` or a string like ``"30min"``; default
            ``"10min"``. A load still waiting then (a server that accepted a GET and never answered) is ended
            with ``RemoteReadTimeoutError`` naming the URL and the deadline. Reads outside a load (a header,
            a listing) get the default, each. Each ranged GET must also answer the range it asked for: a
            server that ignores ``Range`` is refused (``RangeMismatchError``) before more than the range is held.
    """

    max_load_bytes: Optional[int] = None
    upload_part_size: int = multipart.DEFAULT_UPLOAD.part_size
    upload_concurrency: int = multipart.DEFAULT_UPLOAD.concurrency
    read_deadline: Duration = "10min"

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ConfigurationError("RemoteOptions", problems)

    def _problems(self) -> List[str]:
        """Every invalid field, named with its value and the fix."""
        found = []
        cap = self.max_load_bytes
        if cap is not None and (type(cap) is not int or cap < 1):
            found.append(f"max_load_bytes={cap!r} must be a number of bytes >= 1, or None for no cap")
        found += self._deadline_problems()
        try:
            multipart.UploadOptions(self.upload_part_size, self.upload_concurrency)
        except ConfigurationError as err:
            found += [p.replace("part_size=", "upload_part_size=").replace("concurrency=", "upload_concurrency=")
                      for p in err.problems]  # fmt: skip
        return found

    def _deadline_problems(self) -> List[str]:
        try:
            seconds = parse_duration(self.read_deadline, "read_deadline")
        except ValueError as err:
            return [str(err)]
        if not 0 < seconds < float("inf"):  # nan fails too
            return [f"read_deadline={self.read_deadline!r} must be a positive, finite duration such as '10min'"]
        return []

    @property
    def read_deadline_s(self) -> float:
        """``read_deadline`` in seconds."""
        return parse_duration(self.read_deadline, "read_deadline")

    @property
    def upload(self) -> multipart.UploadOptions:
        """The multi-part upload settings (``storage.multipart``)."""
        return multipart.UploadOptions(self.upload_part_size, self.upload_concurrency)


DEFAULT_REMOTE = RemoteOptions()
"""No load cap; 16 MiB parts, 8 in flight; 10 minutes per remote load."""
