"""A second local account for tests where another user is involved (a squatted name, a planted directory)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

OTHER = "lr-test-other"
"""The second user's name; made once with ``useradd`` (no home, no shell) where it is missing."""


def other_user() -> tuple[int, int]:
    """The second user's uid and gid; the test is skipped where this process cannot act as another user."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("acting as a second local user needs root (useradd, setpriv)")
    if subprocess.run(["id", "-u", OTHER], capture_output=True).returncode != 0:
        if shutil.which("useradd") is None:
            pytest.skip("no useradd to create a second local user")
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER], check=True)
    uid = int(subprocess.run(["id", "-u", OTHER], capture_output=True, text=True, check=True).stdout)
    gid = int(subprocess.run(["id", "-g", OTHER], capture_output=True, text=True, check=True).stdout)
    return uid, gid
