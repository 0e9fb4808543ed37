"""The files ``prove`` and its trainee share: opened so that nothing the trainee (or another user) puts in
their place can redirect a write, hang a read or take unbounded memory.

A trace directory is made here (mode 0700) or checked on its descriptor: a directory, not a link, owned by
this user and writable by no one else; a trace file is opened relative to that descriptor with
``O_NOFOLLOW`` and must be a regular file of this user. Every read of a file the trainee can write (its
trace, its log) opens ``O_NOFOLLOW | O_NONBLOCK`` (a link or a FIFO planted there costs nothing), checks on
the descriptor that it is a regular file, and reads with a bound: lines longer than ``MAX_RECORD`` bytes
are refused by name, tails are read from the end, and a poll reads only what was appended since the last
one. Mechanism only, and imported by the trainee's ``ExactResume``: nothing here but ``os`` and ``stat``.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from typing import Iterator, Sequence

from lightning_resume.errors import LightningResumeError

MAX_RECORD = 1 << 20
"""The longest trace line read, in bytes (a record with thousands of checkpoint names is far shorter)."""

CHUNK = 1 << 16
"""Bytes read per system call."""

_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
_APPEND = (
    os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
)  # read: the torn-line check


class UnsafeRunFile(LightningResumeError, OSError):
    """A file or directory of ``prove``'s runs that is not what it should be (a link, a FIFO, another
    user's, open to others, a line too long to be a record)."""

    def __init__(self, path: str, reason: str, fix: str = "remove it, or give the run another directory") -> None:
        self.path, self.reason = path, reason
        super().__init__(f"{path} {reason}; {fix}")


# ------------------------------------------------------------------------------------ run directories


@dataclass(frozen=True)
class RunDirectory:
    """A directory ``make_run_directory`` created, known by its inode: everything in it is the runs'."""

    path: str
    dev: int
    ino: int


def make_run_directory(path: str) -> RunDirectory:
    """Create ``path`` (0700); ``UnsafeRunFile`` when anything is there already: a proof never reuses, so
    never deletes, what it did not create."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        raise UnsafeRunFile(
            path, "already exists", "prove never reuses or deletes what it did not create: move it away"
            " (an earlier proof's runs?) or give another --workdir",
        ) from None  # fmt: skip
    st = os.lstat(path)
    return RunDirectory(path, st.st_dev, st.st_ino)


def remove_created(run: RunDirectory, suffixes: Sequence[str], keep: Sequence[str] = ("trace",)) -> None:
    """The regular files with one of ``suffixes`` under ``run`` (which held nothing before the runs, so all
    of them are the runs'), then its directories left empty but those named ``keep``. Nothing when
    ``run.path`` is no longer the directory made; a link is never followed nor removed."""
    try:
        top = os.open(run.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        st = os.fstat(top)
        if (st.st_dev, st.st_ino) != (run.dev, run.ino):
            return
        for _, dirs, names, fd in os.fwalk(".", topdown=False, follow_symlinks=False, dir_fd=top):
            for name in names:
                if name.endswith(tuple(suffixes)) and stat.S_ISREG(os.lstat(name, dir_fd=fd).st_mode):
                    os.unlink(name, dir_fd=fd)
            for name in dirs:
                if name not in keep:
                    with contextlib.suppress(OSError):  # not empty: something else is in it, and stays
                        os.rmdir(name, dir_fd=fd)
    finally:
        os.close(top)


# ------------------------------------------------------------------------------------------- writing


def trace_directory(path: str) -> int:
    """A descriptor of ``path``, made here (0700, parents as needed) or checked: a directory, not a link,
    owned by this user, not writable by group or others. ``UnsafeRunFile`` naming why otherwise."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        kind = "is a symbolic link" if os.path.islink(path) else f"cannot be opened as a directory ({err})"
        raise UnsafeRunFile(path, kind, "give LIGHTNING_RESUME_TRACE a directory of your own") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            problem = f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
        elif st.st_mode & 0o022:
            problem = f"has mode {stat.S_IMODE(st.st_mode):04o}: other users can write in it"
        else:
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    raise UnsafeRunFile(path, problem, "give LIGHTNING_RESUME_TRACE a directory of your own")


def open_append(directory_fd: int, name: str, shown: str) -> int:
    """``name`` in the directory of ``directory_fd``, opened to append (created 0600 if missing), never
    through a link; ``UnsafeRunFile`` unless it is a regular file of this user (``shown``: its path)."""
    try:
        fd = os.open(name, _APPEND, 0o600, dir_fd=directory_fd)
    except OSError as err:
        raise UnsafeRunFile(shown, f"cannot be opened to append a trace ({err.strerror}): a link or a FIFO?") from None
    problem = _not_mine(os.fstat(fd))
    if problem:
        os.close(fd)
        raise UnsafeRunFile(shown, problem)
    return fd


def _not_mine(st: os.stat_result) -> str:
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to this user"
    return ""


# ------------------------------------------------------------------------------------------- reading


def open_regular(path: str) -> int:
    """A read descriptor of ``path``, never through a link and never blocking; ``UnsafeRunFile`` unless it
    is a regular file."""
    try:
        fd = os.open(path, _READ)
    except OSError as err:
        why = "is a symbolic link" if os.path.islink(path) else f"cannot be read ({err.strerror})"
        raise UnsafeRunFile(path, why) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeRunFile(path, "is not a regular file (a FIFO, a device or a directory)")
    return fd


def read_tail(path: str, chars: int) -> str:
    """The last ``chars`` characters of a text file, read from its end (at most ``4 * chars`` bytes); a
    file that is not a regular file reads as a sentence saying so."""
    try:
        fd = open_regular(path)
    except UnsafeRunFile as err:
        return f"({err})"
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - 4 * chars)
        data = os.pread(fd, size - start, start)
    finally:
        os.close(fd)
    return data.decode("utf-8", errors="replace")[-chars:]


def read_lines(path: str, max_line: int = MAX_RECORD) -> Iterator[bytes]:
    """The lines of a regular file (without their newline; the last one too, unended), read in chunks;
    never more than ``max_line + CHUNK`` bytes held. A longer line raises ``UnsafeRunFile`` naming it."""
    fd = open_regular(path)
    try:
        pending = b""
        number = 0
        while chunk := os.read(fd, CHUNK):
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                number += 1
                yield _bounded(path, number, line, max_line)
            _bounded(path, number + 1, pending, max_line)
        if pending:
            yield pending
    finally:
        os.close(fd)


def _bounded(path: str, number: int, line: bytes, max_line: int) -> bytes:
    if len(line) > max_line:
        raise UnsafeRunFile(f"{path}:{number}", f"is longer than {max_line} bytes: not a trace record")
    return line


@dataclass
class Follower:
    """Reads a growing file from ``offset`` on, one poll at a time: each ``poll`` returns the whole lines
    appended since the last (at most ``max_line + CHUNK`` bytes read per poll) and remembers where it
    stopped, so a poll never reads again what an earlier one read."""

    path: str
    offset: int = 0
    max_line: int = MAX_RECORD

    def poll(self) -> list[bytes]:
        try:
            fd = open_regular(self.path)
        except UnsafeRunFile:
            if not os.path.lexists(self.path):
                return []  # not written yet
            raise
        try:
            data = os.pread(fd, self.max_line + CHUNK, self.offset)
        finally:
            os.close(fd)
        end = data.rfind(b"\n")
        if end < 0:
            if len(data) > self.max_line:
                raise UnsafeRunFile(self.path, f"has a line longer than {self.max_line} bytes: not a trace record")
            return []
        self.offset += end + 1
        return data[:end].split(b"\n")


def offset_of(path: str) -> int:
    """The size of ``path`` if it is a regular file (not a link), else 0: where this launch's records begin."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0
