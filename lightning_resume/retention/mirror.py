"""The mirror: copies of local checkpoints uploaded to a second location (an object store) in the background.

:class:`MirrorUploader` owns one uploader thread (``threads.OrderedWriter``, its own queue, below training's CPU
and I/O priority) and the bookkeeping of the uploads: which are queued, which failed, how often and when.
An upload waits until its local file is durable (an async save's write may still be running), copies it
with ``format.atomic.atomic_write`` (upload, then commit: the object appears whole or not at all; transient
errors retried with backoff by ``storage.with_retries``), and checks that the mirror's copy has the local
size. Deletions in the mirror run on the same queue, after the uploads submitted before them. Nothing here
raises on the training thread: an upload that fails is reported by :meth:`MirrorUploader.settle` (the caller
warns, naming it) and tried again when :class:`tiers.UploadRetry` says so, never dropped. A process killed
mid-upload leaves no object under the final name (at worst an incomplete multi-part upload, which
``format.atomic.clean_stale_temporaries`` aborts later); its next start uploads again what the mirror lacks.

A dedupe checkpoint (one with references, docs/safetensors-io.md) is uploaded as :func:`copy_checkpoint` does:
first each pack it references that the mirror lacks (under ``blocks/``, the same name), then the checkpoint file,
so the mirror never holds a checkpoint whose packs it lacks. A deletion in the mirror then collects the mirror's
packs no checkpoint there references any more (``cas.gc.remove_and_collect``), on the same queue: an upload
queued after it checks for its packs when it runs, and uploads again one the collection removed.

Knows files (through ``storage`` and ``format.atomic``) and threads; decides nothing about what to keep
(``tiers``) and knows nothing of Lightning.
"""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import dataclass
from typing import BinaryIO, Callable, Optional

from lightning_resume._compat.botocore import isolate_retry_jitter
from lightning_resume.cas.gc import collect_quietly, remove_and_collect
from lightning_resume.cas.layout import pack_path
from lightning_resume.cas.refs import packs_of
from lightning_resume.format.atomic import atomic_write
from lightning_resume.format.read import is_safetensors
from lightning_resume.retention.tiers import UploadRetry
from lightning_resume.storage import files as storage
from lightning_resume.threads import Job, OrderedWriter

COPY_CHUNK = 8 << 20
"""Bytes read from the local file per write into the upload (the client buffers parts of its own size)."""
READY_POLL_S = 0.02
"""How often an upload checks whether its local file's write has finished."""

Ready = Callable[[], bool]
"""Whether the local file is durable (its write, maybe on another worker, has finished)."""


class UploadFailed(OSError):
    """An upload that did not land, naming both ends; ``cause`` is the storage error."""

    def __init__(self, source: str, target: str, cause: BaseException) -> None:
        self.source, self.target, self.cause = source, target, cause
        super().__init__(f"upload of {source} to {target} failed: {type(cause).__name__}: {cause}")


@dataclass(frozen=True)
class Outcome:
    """A finished upload: ``error`` is ``None`` when the mirror has ``target``; ``failures`` counts the
    failures in a row of this upload so far (``0`` on success); ``source_gone``: there was nothing to upload
    (the local write failed), so nothing is retried."""

    source: str
    target: str
    error: Optional[UploadFailed] = None
    failures: int = 0
    source_gone: bool = False


@dataclass
class _Failure:
    count: int
    at: float


def copy_file(source: str, target: str) -> None:
    """Copy ``source`` to ``target`` atomically (either end local or a URL), then check the copy's size."""
    expected = storage.size(source)
    if expected is None:
        raise FileNotFoundError(f"{source} is gone: nothing to upload")

    def write(f: BinaryIO) -> None:
        with storage.open_read(source) as src:
            shutil.copyfileobj(src, f, COPY_CHUNK)

    atomic_write(target, write)
    landed = storage.size(target)
    if landed != expected:
        raise OSError(f"the copy at {target} has {landed} bytes where {source} has {expected}")


def copy_checkpoint(source: str, target: str) -> None:
    """Copy the checkpoint ``source`` to ``target`` (:func:`copy_file`), after the packs it references that the
    target's directory lacks (or holds with another size: never a half object, but a pack of that name from
    elsewhere). A file without references is copied alone."""
    for name in sorted(packs_of(source) if is_safetensors(source) else ()):
        here, there = pack_path(source, name), pack_path(target, name)
        size = storage.size(here)
        if size is None:  # never a mirrored checkpoint without its blocks: the upload fails, named, and is retried
            raise FileNotFoundError(
                f"{source} references the pack {here}, which is missing; the checkpoint is not mirrored"
            )
        if storage.size(there) != size:
            copy_file(here, there)
    copy_file(source, target)


class MirrorUploader:
    """Uploads local checkpoints to ``directory`` on one background thread, in submission order.

    ``transfer`` copies one checkpoint (``copy_checkpoint``; tests pass a slower or failing one); ``retry`` spaces the
    attempts of a failing upload; ``clock`` (``time.monotonic``) is what those spaces are measured on.
    """

    def __init__(
        self,
        directory: str,
        transfer: Callable[[str, str], None] = copy_checkpoint,
        retry: Optional[UploadRetry] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = str(directory)
        if storage.is_remote(self.directory):
            isolate_retry_jitter()
        self.retry = retry if retry is not None else UploadRetry()
        self._transfer = transfer
        self._clock = clock
        self._writer = OrderedWriter(name="lightning-resume-mirror")
        self._lock = threading.Lock()
        self._done: list[Outcome] = []
        self._failures: dict[str, _Failure] = {}  # source -> failures in a row, and when the last one was

    def target(self, source: str) -> str:
        """Where the mirror keeps its copy of ``source``: the same name in ``directory`` (scheme kept)."""
        return storage.join(self.directory, storage.basename(str(source)))

    def upload(self, source: str, ready: Ready = lambda: True) -> str:
        """Queue the upload of ``source`` (once ``ready()``); a no-op if one is queued already. Its target."""
        source, target = str(source), self.target(source)
        if not self._writer.outstanding(target, "upload"):
            self._writer.submit(Job("upload", target, lambda: self._run_upload(source, target, ready)))
        return target

    def remove(self, target: str) -> None:
        """Queue the deletion of the mirror's ``target``, after every upload queued before it; then the mirror's
        packs of its lineage that no checkpoint there references any more are collected."""

        def remove() -> None:
            remove_and_collect(str(target))

        self._writer.submit(Job("remove", str(target), remove))

    def collect(self, lineage: str) -> None:
        """Queue a collection of the mirror's packs of ``lineage`` that no checkpoint there references (those of an
        upload killed between its packs and its file), after every job queued before it (``cas.gc``)."""

        def run() -> None:
            collect_quietly(self.directory, lineage, temporaries=False)

        self._writer.submit(Job("collect", self.directory, run))

    def retry_due(self) -> list[str]:
        """Queue again each failed upload whose wait (``retry``) is over; the sources queued."""
        now = self._clock()
        with self._lock:
            due = [s for s, f in self._failures.items() if self.retry.due(f.count, f.at, now)]
        for source in due:
            if not self.uploading(source):
                self.upload(source)
        return due

    def uploading(self, source: Optional[str] = None) -> bool:
        """Whether an upload (of ``source``, if given) is queued or running."""
        target = None if source is None else self.target(source)
        return bool(self._writer.outstanding(target, "upload"))

    def settle(self) -> list[Outcome]:
        """The uploads finished since the last call, oldest first (each handed out once)."""
        self._writer.take_failed()  # deletions that failed: the file is still listed, so retention tries again
        with self._lock:
            done, self._done = self._done, []
        return done

    def wait(self, source: Optional[str] = None, timeout: Optional[float] = None) -> bool:
        """Block until the upload of ``source`` (or every queued job) is done; ``False`` on ``timeout``."""
        target = None if source is None else self.target(source)
        return self._writer.wait(self._writer.outstanding(target), timeout)

    def _run_upload(self, source: str, target: str, ready: Ready) -> None:
        while not ready():
            time.sleep(READY_POLL_S)
        try:
            self._transfer(source, target)
        except FileNotFoundError as err:
            if storage.exists(source):  # the mirror refused it (no bucket): a failure like any other
                return self._finish(source, target, err)
            return self._finish(source, target, None, source_gone=True)
        except Exception as err:  # noqa: BLE001 - any error of the store is reported, never raised on a thread
            return self._finish(source, target, err)
        return self._finish(source, target, None)

    def _finish(self, source: str, target: str, err: Optional[BaseException], source_gone: bool = False) -> None:
        with self._lock:
            if err is None:
                self._failures.pop(source, None)
                outcome = Outcome(source, target, source_gone=source_gone)
            else:
                failure = self._failures.get(source) or _Failure(0, 0.0)
                failure = self._failures[source] = _Failure(failure.count + 1, self._clock())
                outcome = Outcome(source, target, UploadFailed(source, target, err), failure.count)
            self._done.append(outcome)
