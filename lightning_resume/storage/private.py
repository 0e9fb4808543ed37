"""Directories and small files on a machine shared with other users (``/dev/shm``, a login node's tmpfs).

``/dev/shm`` is world-writable: any user can create a name there before us, make it a symbolic link, or
plant files in a directory we did not check. What lives under a root made here is trusted only after
``lstat`` shows a real directory (not a link) owned by this user with no access for anyone else (0700);
a root that fails is refused with the reason, never used. Where a parent is writable by others (a team
ramdisk, mode 0777 without the sticky bit), a name can be renamed away between a check and a use, so
:func:`open_private_dir` opens the directory once (``O_DIRECTORY | O_NOFOLLOW``) and checks the descriptor
(``fstat``): what was checked is what is used, by names relative to it. Files are created with ``O_EXCL | O_NOFOLLOW``
(never through a link someone planted) and read with a size bound and ``O_NONBLOCK`` (a FIFO or a
sparse 64 GiB file planted under an expected name costs nothing). Mechanism only: what to do about an
untrusted root is the caller's decision. Local paths only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import Optional

PRIVATE_MODE = 0o700
"""A private directory: its owner alone may list, enter or change it."""

PRIVATE_FILE_MODE = 0o600
"""A private file: its owner alone may read or write it."""

SMALL_FILE_LIMIT = 4096
"""The most bytes :func:`read_small` reads; a bigger file reads as nothing."""


class UntrustedDirectory(OSError):
    """A directory that should be this user's alone is not (another owner, open mode, a link, not a directory)."""

    def __init__(self, path: str, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(
            f"{path} {reason}, so it cannot be trusted with training state; remove it (as its owner) or"
            " choose another directory"
        )


def user_root(parent: str, prefix: str) -> str:
    """``<parent>/<prefix>-<uid>``: one directory per user, so users never share (or block) one."""
    return os.path.join(parent, f"{prefix}-{os.geteuid()}")


def private_dir(path: str) -> str:
    """Make ``path`` (mode 0700; its parent must exist) or check the one there: a directory, not a link,
    owned by this user, closed to others. Returns ``path``; ``UntrustedDirectory`` naming why otherwise."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, PRIVATE_MODE)
    check_private(path)
    return path


_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
"""A directory opened as itself: never through a link, never a file of another kind."""


def open_private_dir(name: str, dir_fd: Optional[int] = None, create: bool = False, shown: str = "") -> int:
    """A descriptor of the directory ``name`` (relative to ``dir_fd`` when given), made first (0700) with
    ``create``, checked on the descriptor as :func:`check_private` checks a path. ``shown``: the path named in
    errors. ``FileNotFoundError`` when it is missing; ``UntrustedDirectory`` naming why it cannot be used."""
    shown = shown or name
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, PRIVATE_MODE, dir_fd=dir_fd)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):  # which of the two, for the message only
            raise UntrustedDirectory(shown, _what_is_there(name, dir_fd)) from err
        raise
    try:
        _check_stat(shown, os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _what_is_there(name: str, dir_fd: Optional[int]) -> str:
    with contextlib.suppress(OSError):
        if stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode):
            return "is a symbolic link"
    return "is not a directory"


def fd_path(fd: int, fallback: str) -> str:
    """A path that reaches the directory open as ``fd`` itself, not whatever is at its name now
    (``/proc/self/fd/<fd>``), for code that takes paths; ``fallback`` where the system has no such paths."""
    return f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else fallback


def check_private(path: str) -> None:
    """``UntrustedDirectory`` unless ``path`` is a directory (not a link) of this user with mode 0700 or less."""
    _check_stat(path, os.lstat(path))


def _check_stat(path: str, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise UntrustedDirectory(path, "is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedDirectory(path, "is not a directory")
    if st.st_uid != os.geteuid():
        raise UntrustedDirectory(path, f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")
    if st.st_mode & 0o077:
        raise UntrustedDirectory(
            path, f"has mode {stat.S_IMODE(st.st_mode):04o}: other users may enter it (0700 needed)"
        )


def owned_by_me(path: str) -> bool:
    """``path`` exists, is not a link, and belongs to this user."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return not stat.S_ISLNK(st.st_mode) and st.st_uid == os.geteuid()


def read_small(path: str, limit: int = SMALL_FILE_LIMIT, follow_links: bool = False) -> str:
    """The stripped ASCII text of a small regular file; ``""`` for anything else (missing, a link unless
    ``follow_links``, a FIFO or device, over ``limit`` bytes, not ASCII). Never blocks and never reads more
    than ``limit + 1`` bytes."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError:
        return ""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return ""
        data = os.read(fd, limit + 1)
    except OSError:
        return ""
    finally:
        os.close(fd)
    if len(data) > limit:
        return ""
    try:
        return data.decode("ascii").strip()
    except UnicodeDecodeError:
        return ""
