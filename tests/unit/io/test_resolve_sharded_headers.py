"""What the memory tier reads of a durable sharded checkpoint before it resumes from memory: the directory's
``COMMITTED`` marker and the header of its ``meta.safetensors`` (the run id and step), never a shard nor DCP's
``.metadata``. Both readers it uses: ``io.resolve.header_value`` (the run id; before, ``None`` for a directory, so
a sharded run was taken for a fresh start) and ``io.verify.header_only`` ("last" resolution while the memory tier
is asked first; before, every file hashed). Counted on a local directory (every file opened, by an audit hook) and
on the S3 test server (every object GET, by a WSGI middleware), where Lightning is handed the marker's path."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.io.resolve import header_value, progress
from lightning_resume.io.sharded_strategy import lightning_path
from lightning_resume.io.verify import header_only
from lightning_resume.sharded.api import save_sharded
from lightning_resume.sharded.marker import MARKER, META_FILE

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]

RUN = ("callbacks", "ExactResume", "memory_run")
META = {"global_step": 6, "callbacks": {"ExactResume": {"memory_run": "0123456789abcdef"}}}


def _save(directory: str) -> str:
    state = {"model": {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(3)}}
    return save_sharded(state, directory, 6, meta=META)


class _Opened:
    """Local files opened under a root while ``on`` (an audit hook: ``open`` and ``os.open`` both report)."""

    def __init__(self, root: Path) -> None:
        self.root, self.on, self.paths = str(root), False, []  # type: ignore[var-annotated]

    def __call__(self, event: str, args: tuple) -> None:
        if self.on and event == "open" and isinstance(args[0], str) and args[0].startswith(self.root):
            self.paths.append(Path(args[0]).name)


@pytest.fixture(scope="module")
def opened(tmp_path_factory: pytest.TempPathFactory) -> _Opened:
    root = tmp_path_factory.mktemp("opened")
    hook = _Opened(root)
    sys.addaudithook(hook)  # cannot be removed: it records only while a test turns it on
    return hook


def _reads_of(opened: _Opened, read: Callable[[], object]) -> tuple[object, list[str]]:
    opened.paths, opened.on = [], True
    try:
        return read(), sorted(set(opened.paths))
    finally:
        opened.on = False


@pytest.mark.parametrize("reader", ["header_value", "header_only"])
def test_a_local_sharded_directory_is_read_by_its_marker_and_meta_header(opened: _Opened, reader: str) -> None:
    directory = _save(str(Path(opened.root) / "step=6"))
    read = (lambda: header_value(directory, RUN)) if reader == "header_value" else (lambda: header_only(directory))
    value, names = _reads_of(opened, read)
    assert names == [MARKER, META_FILE], f"{reader} opened {names}"
    if reader == "header_value":
        assert value == "0123456789abcdef"
        assert header_value(directory, ("global_step",)) == 6 and progress(directory) is not None


def test_an_uncommitted_or_meta_less_directory_is_refused_by_name(tmp_path: Path) -> None:
    directory = _save(str(tmp_path / "step=6"))
    (Path(directory) / MARKER).unlink()
    with pytest.raises(CheckpointCorruptError, match=f"no {MARKER} marker"):
        header_only(directory)
    with pytest.raises(CheckpointCorruptError, match=f"no {MARKER} marker"):
        header_value(directory, RUN)
    bare = save_sharded({"model": {"w": torch.ones(2)}}, str(tmp_path / "bare"), 1)  # no meta: not Lightning's
    with pytest.raises(CheckpointCorruptError, match=re.escape(f"does not list {META_FILE}")):
        header_only(bare)


class _ObjectGets:
    """The keys of object GETs the S3 server answered while ``on`` (listings, with no key, aside)."""

    def __init__(self) -> None:
        self.on, self.keys = False, []  # type: ignore[var-annotated]

    def wrap(self, app):
        def middleware(environ, start_response):
            _, _, key = environ.get("PATH_INFO", "").lstrip("/").partition("/")
            if self.on and environ.get("REQUEST_METHOD") == "GET" and key:
                self.keys.append(key.rsplit("/", 1)[-1])
            return app(environ, start_response)

        return middleware


@pytest.fixture
def object_gets(s3_server) -> Iterator[_ObjectGets]:
    with s3_server.watched(_ObjectGets()) as gets:
        yield gets


@pytest.mark.parametrize("named", ["directory", "marker"])
@pytest.mark.parametrize("reader", ["header_value", "header_only"])
def test_an_s3_sharded_directory_is_read_by_its_marker_and_meta_header(
    s3_bucket: str, object_gets: _ObjectGets, reader: str, named: str
) -> None:
    """``named="marker"``: the path Lightning is handed for an object-store directory (``lightning_path``)."""
    directory = _save(f"{s3_bucket}/run/step=6")
    path = lightning_path(directory) if named == "marker" else directory
    assert path.endswith(MARKER) == (named == "marker")
    object_gets.on = True
    try:
        value = header_value(path, RUN) if reader == "header_value" else header_only(path)
    finally:
        object_gets.on = False
    assert set(object_gets.keys) == {MARKER, META_FILE}, object_gets.keys
    if reader == "header_value":
        assert value == "0123456789abcdef"
    assert object_gets.keys.count(META_FILE) <= 3, "the meta file is read as far as its header: a few ranged GETs"
