"""Issue 15 item 11: ``clean_uncommitted`` removes only what killed saves left, and reports only what it removed;
the commit marker is read as strictly as every other JSON of a checkpoint."""

from __future__ import annotations

import os

import pytest

from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.sharded.commit import clean_uncommitted
from lightning_resume.sharded.marker import FORMAT, MARKER, read_marker


def test_a_symlinked_hidden_directory_is_neither_followed_nor_reported_removed(tmp_path):
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("keep")
    os.symlink(elsewhere, root / ".step-1.partial-deadbeef")
    assert clean_uncommitted(str(root)) == []
    assert (elsewhere / "precious.txt").read_text() == "keep"


def test_a_directory_without_a_hidden_name_is_never_removed(tmp_path):
    """Only the hidden siblings a save leaves are removed: an uncommitted directory under a plain name
    (a user's, or another tool's DCP save) is left as it is."""
    user = tmp_path / "notes"
    user.mkdir()
    (user / "draft.md").write_text("mine")
    foreign = tmp_path / "step-1"
    foreign.mkdir()
    (foreign / "__0_0.distcp").write_bytes(b"x")
    (foreign / ".metadata").write_bytes(b"x")
    assert clean_uncommitted(str(tmp_path)) == []
    assert (user / "draft.md").read_text() == "mine" and sorted(os.listdir(foreign)) == [".metadata", "__0_0.distcp"]


def test_a_commit_marker_with_a_key_twice_or_nested_too_deep_is_corrupt(tmp_path):
    body = f'{{"format": "{FORMAT}", "step": 1, "world_size": 1, "files": {{}}, "step": 2}}'
    (tmp_path / MARKER).write_text(body)
    with pytest.raises(CheckpointCorruptError, match="more than once"):
        read_marker(str(tmp_path))
    (tmp_path / MARKER).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointCorruptError, match="malformed"):
        read_marker(str(tmp_path))
