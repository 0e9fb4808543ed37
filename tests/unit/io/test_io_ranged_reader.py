"""``storage.RangedReader``'s read-ahead: ``reader_streams`` ranged GETs in flight ahead of a sequential read, each
byte requested once, and nothing fetched after the reader is closed. On ``memory://`` with each GET slowed so
that the GETs overlap, recorded through the filesystem's ``cat_file``."""

from __future__ import annotations

import threading
import time
import uuid

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from lightning_resume.storage import files as storage

pytestmark = pytest.mark.timeout(60)

CHUNK = 1000


@pytest.fixture
def recorded(monkeypatch) -> dict:
    """Every ranged GET ``(start, end)`` the reader makes, and the most in flight at once."""
    monkeypatch.setattr(storage, "READ_CHUNK", CHUNK)
    seen: dict = {"gets": [], "in_flight": 0, "most": 0}
    lock = threading.Lock()
    real = MemoryFileSystem.cat_file

    def cat_file(self, path, start=None, end=None, **kwargs):
        with lock:
            seen["gets"].append((start, end))
            seen["in_flight"] += 1
            seen["most"] = max(seen["most"], seen["in_flight"])
        try:
            time.sleep(0.01)
            return real(self, path, start=start, end=end, **kwargs)
        finally:
            with lock:
                seen["in_flight"] -= 1

    monkeypatch.setattr(MemoryFileSystem, "cat_file", cat_file)
    return seen


def _blob(size: int) -> tuple[str, bytes]:
    url = f"memory://reader-{uuid.uuid4().hex[:8]}/blob"
    data = bytes(i % 251 for i in range(size))
    fsspec.filesystem("memory").pipe_file(url, data)
    return url, data


def test_a_sequential_read_requests_each_chunk_once_with_streams_in_flight(recorded: dict) -> None:
    url, data = _blob(64 * CHUNK + 123)
    reader = storage.RangedReader(url, len(data))
    assert reader.streams == storage.reader_streams(len(data)) == 8
    out = bytearray(len(data))
    view, got = memoryview(out), 0
    while got < len(out):
        got += reader.readinto(view[got : got + 700])  # reads that straddle chunk boundaries
    reader.close()
    assert bytes(out) == data
    assert sorted(recorded["gets"]) == [(a, min(a + CHUNK, len(data))) for a in range(0, len(data), CHUNK)]
    assert 1 < recorded["most"] <= reader.streams


def test_a_seek_restarts_the_read_ahead_there_and_close_stops_it(recorded: dict) -> None:
    url, data = _blob(64 * CHUNK)
    reader = storage.RangedReader(url, len(data))
    assert reader.read(10) == data[:10]
    reader.seek(40 * CHUNK + 5)
    assert reader.read(3 * CHUNK) == data[40 * CHUNK + 5 : 43 * CHUNK + 5]
    reader.close()
    fetched = len(recorded["gets"])
    time.sleep(0.05)
    assert len(recorded["gets"]) == fetched  # nothing requested after close
    assert (40 * CHUNK, 41 * CHUNK) in recorded["gets"] and all(a < 52 * CHUNK for a, _ in recorded["gets"])
