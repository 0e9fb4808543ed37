"""What ``prove`` and its trainee do with files the other side (or another user) can replace: the trace is
never written through a planted link or into a directory another user can write; a FIFO, a link to
``/dev/zero`` or a line of megabytes in place of a trace is refused by name, read with a bound (never
blocking, never more than a line's bound held), and a kill poll reads only what was appended since the last;
a log's tail is read from its end."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from lightning_resume.exact.state import fingerprint, rng
from lightning_resume.prove import compare, files, runner, trace
from tests.helpers.accounts import other_user

pytestmark = pytest.mark.timeout(120)

"""The second local user (as in tests/unit/exact/test_memory_tier_shared_machine.py)."""


def _recorder(directory: Path, rank: int = 0) -> trace.TraceRecorder:
    recorder = trace.from_environment(rank, fingerprint.digest, rng.capture_rng, {trace.TRACE_ENV: str(directory)})
    assert recorder is not None
    return recorder


# ------------------------------------------------------------------------------------------- writing


def test_a_link_planted_at_the_trace_path_is_not_followed_and_the_trainee_says_why(tmp_path: Path) -> None:
    victim = tmp_path / "bashrc"
    victim.write_bytes(b"export PATH=/usr/bin\n")
    os.chmod(victim, 0o600)
    (tmp_path / "trace").mkdir(mode=0o700)
    os.symlink(victim, tmp_path / "trace" / "trace-rank0.jsonl")
    with pytest.raises(files.UnsafeRunFile, match=r"trace-rank0\.jsonl cannot be opened to append a trace"):
        _recorder(tmp_path / "trace")
    assert victim.read_bytes() == b"export PATH=/usr/bin\n"


def test_a_fifo_at_the_trace_path_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "trace-rank0.jsonl")  # no reader: a blocking open for writing would hang
    with pytest.raises(files.UnsafeRunFile, match="trace-rank0.jsonl"):
        _recorder(tmp_path)


def test_a_trace_directory_others_can_write_or_a_linked_one_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(files.UnsafeRunFile, match="has mode 0777: other users can write in it"):
        _recorder(shared)
    assert list(shared.iterdir()) == []
    (tmp_path / "mine").mkdir(mode=0o700)
    os.symlink(tmp_path / "mine", tmp_path / "link")
    with pytest.raises(files.UnsafeRunFile, match="link is a symbolic link"):
        _recorder(tmp_path / "link")
    assert list((tmp_path / "mine").iterdir()) == []


def test_a_new_trace_directory_and_file_are_the_users_alone(tmp_path: Path) -> None:
    _recorder(tmp_path / "a" / "trace").close()
    assert (tmp_path / "a" / "trace").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "a" / "trace" / "trace-rank0.jsonl").stat().st_mode & 0o777 == 0o600


@pytest.fixture
def shared() -> Iterator[Path]:
    """A fresh directory like /tmp: world-writable, sticky, reachable by the second user."""
    root = Path(tempfile.mkdtemp(prefix="lr-prove-shared-", dir="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"))
    os.chmod(root, 0o1777)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_a_trace_directory_another_user_made_first_is_refused(shared: Path) -> None:
    uid, gid = other_user()
    made = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "mkdir", "-m", "0755", str(shared / "t")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    with pytest.raises(files.UnsafeRunFile, match=f"belongs to uid {uid}, not to this user"):
        _recorder(shared / "t")


# ------------------------------------------------------------------------------------------- reading


def test_a_fifo_or_a_link_to_dev_zero_as_a_trace_is_named_not_read(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "trace-rank0.jsonl")  # no writer: a blocking read would wait forever
    with pytest.raises(files.UnsafeRunFile, match="trace-rank0.jsonl is not a regular file"):
        compare.read_trace(tmp_path)
    os.unlink(tmp_path / "trace-rank0.jsonl")
    os.symlink("/dev/zero", tmp_path / "trace-rank0.jsonl")  # read whole, it never ends
    with pytest.raises(files.UnsafeRunFile, match="trace-rank0.jsonl is a symbolic link"):
        compare.read_trace(tmp_path)
    run = tmp_path / "A"
    (run / "trace").mkdir(parents=True)
    os.symlink("/dev/zero", run / "trace" / "trace-rank0.jsonl")
    with pytest.raises(runner.RunFailed, match="A: its trace cannot be read: .* is a symbolic link"):
        runner.read_trace(run)


def _spy(monkeypatch, name: str) -> list[tuple[int, ...]]:
    calls: list[tuple[int, ...]] = []
    real = getattr(os, name)

    def spy(fd: int, *args: int) -> bytes:
        calls.append(args)
        return real(fd, *args)

    monkeypatch.setattr(files.os, name, spy)
    return calls


def test_a_line_longer_than_the_bound_is_a_malformed_record_read_with_bounded_memory(tmp_path, monkeypatch):
    path = tmp_path / "trace-rank0.jsonl"
    path.write_bytes(b'{"kind":"start","step":0}\n{"kind":"batch","x":"' + b"y" * (3 * files.MAX_RECORD) + b'"}\n')
    reads = _spy(monkeypatch, "read")
    with pytest.raises(files.UnsafeRunFile, match=r"trace-rank0\.jsonl:2 is longer than 1048576 bytes"):
        compare.read_trace(tmp_path)
    held = sum(size for (size,) in reads)  # every byte read: the bound plus one chunk, not the 3 MiB line
    assert all(size == files.CHUNK for (size,) in reads) and held <= files.MAX_RECORD + 2 * files.CHUNK


def test_a_kill_poll_reads_only_what_was_appended_and_never_more_than_a_line_bound(tmp_path, monkeypatch):
    trace_dir = tmp_path / "trace"
    trace_dir.mkdir()
    path = trace_dir / "trace-rank0.jsonl"
    path.write_bytes(b'{"kind":"start","step":0}\n{"kind":"batch","step":1}\n{"kind":"ba')
    offsets: dict = {}
    preads = _spy(monkeypatch, "pread")
    assert not runner._reached(trace_dir, 2, offsets)
    assert offsets["trace-rank0.jsonl"] == len(b'{"kind":"start","step":0}\n{"kind":"batch","step":1}\n')
    with open(path, "ab") as f:
        f.write(b'tch","step":2}\n')
    assert runner._reached(trace_dir, 2, offsets)
    assert [offset for _, offset in preads] == [0, 52]  # the second poll began where the first stopped
    assert all(size == files.MAX_RECORD + files.CHUNK for size, _ in preads)
    with open(path, "ab") as f:
        f.write(b"z" * (files.MAX_RECORD + files.CHUNK + 10))  # a line that never ends
    with pytest.raises(files.UnsafeRunFile, match="has a line longer than 1048576 bytes"):
        runner._reached(trace_dir, 3, offsets)


def test_a_fifo_trace_during_a_kill_poll_is_named(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "trace-rank0.jsonl")
    with pytest.raises(files.UnsafeRunFile, match="not a regular file"):
        runner._reached(tmp_path, 1, {})


def test_a_failed_launch_shows_the_tail_of_its_log_read_from_the_end(tmp_path, monkeypatch):
    log = tmp_path / "launch-1.log"
    log.write_bytes(b"x" * 10_000_000 + b"\nTraceback: the end")
    preads = _spy(monkeypatch, "pread")
    message = str(runner.RunFailed("A: exited with 1", log))
    assert message.endswith("x" * (runner.TAIL - 19) + "\nTraceback: the end")
    assert [size for size, _ in preads] == [4 * runner.TAIL]
    os.unlink(log)
    os.mkfifo(log)  # the trainee replaced its log: named, not read
    assert "is not a regular file" in str(runner.RunFailed("A: exited with 1", log))
