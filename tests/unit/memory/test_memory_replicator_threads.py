"""The replicator's threads without a network (the transport replaced by stand-ins): a snapshot offered while
one is in flight replaces the one still waiting (coalesced, its descriptor closed), the newest is always sent
next, and a stop that a hanging peer would block returns after its timeout with a warning."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from lightning_resume.errors import ExactResumeWarning
from lightning_resume.memory import replicate, transport
from lightning_resume.memory.store import MemoryStore, memory_root


def _store(tmp_path: Path) -> MemoryStore:
    return MemoryStore(memory_root(str(tmp_path)), "0123456789abcdef", rank=0, world_size=2)


def _fd(tmp_path: Path, name: str) -> int:
    (tmp_path / name).write_bytes(name.encode())
    return os.open(tmp_path / name, os.O_RDONLY)


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def test_a_snapshot_offered_during_a_transfer_replaces_the_waiting_one(tmp_path: Path, monkeypatch) -> None:
    sending, release, sent = threading.Event(), threading.Event(), []

    def send_file(fd: Any, dst: int, group: Any, record: Any = (), **kw: Any) -> int:
        if fd is None:
            return 0
        sent.append(record)
        sending.set()
        assert release.wait(60)
        return 10

    monkeypatch.setattr(transport, "send_file", send_file)
    monkeypatch.setattr(replicate, "_receive_ack", lambda holder, group: (replicate.STORED, 10, 0))
    replicator = replicate.Replicator(_store(tmp_path), None, holders=[1], owners=[])
    replicator.start()
    replicator.offer(_fd(tmp_path, "a"), step=1, seq=1)
    assert sending.wait(60)  # seq 1 in flight
    waiting = _fd(tmp_path, "b")
    replicator.offer(waiting, step=2, seq=2)
    replicator.offer(_fd(tmp_path, "c"), step=3, seq=3)  # replaces seq 2, which is never sent
    assert _closed(waiting)
    release.set()
    while replicator.sent < 2:
        threading.Event().wait(0.01)
    assert sent == [(1, 1), (3, 3)]
    assert replicator.last_transfer is not None and (replicator.last_transfer.seq, replicator.last_transfer.nbytes) == (
        3,
        10,
    )
    assert replicator.stop(timeout=60)


def test_a_stop_that_a_hanging_peer_blocks_returns_after_its_timeout_with_a_warning(
    tmp_path: Path, monkeypatch
) -> None:
    never = threading.Event()
    monkeypatch.setattr(transport, "recv_file", lambda *a, **k: never.wait() and None)  # no "nothing" comes
    monkeypatch.setattr(transport, "send_file", lambda *a, **k: 0)
    monkeypatch.setattr(replicate, "QUIET_STOP_TIMEOUT_S", 0.1)  # the join after the group is cut
    replicator = replicate.Replicator(_store(tmp_path), None, holders=[1], owners=[1])
    replicator.start()
    with pytest.warns(ExactResumeWarning, match=r"replica transfers \['lightning-resume-replica-1'\] did not end"):
        assert not replicator.stop(timeout=0.2)
    never.set()


def test_no_replicas_no_replicator(tmp_path: Path) -> None:
    plan = replicate.ring(0, num_nodes=2, rank=0, world_size=2)
    assert plan == replicate.Ring() and replicate.start(_store(tmp_path), plan) is None
    assert replicate.after_commit(None) is None
