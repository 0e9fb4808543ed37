"""Directories and small files on a machine shared with other users (``/dev/shm``, a login node's tmpfs).

``/dev/shm`` is world-writable: any user can create a name there before us, make it a symbolic link, or
plant files in a directory we did not check. What lives under a root made here is trusted only after
``lstat`` shows a real directory (not a link) owned by this user with no access for anyone else (0700);
a root that fails is refused with the reason, never used. Files are created with ``O_EXCL | O_NOFOLLOW``
(never through a link someone planted) and read with a size bound and ``O_NONBLOCK`` (a FIFO or a
sparse 64 GiB file planted under an expected name costs nothing). Mechanism only: what to do about an
untrusted root is the caller's decision. Local paths only.
"""

from __future__ import annotations

import contextlib
import os
import stat

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


def check_private(path: str) -> None:
    """``UntrustedDirectory`` unless ``path`` is a directory (not a link) of this user with mode 0700 or less."""
    st = os.lstat(path)
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
