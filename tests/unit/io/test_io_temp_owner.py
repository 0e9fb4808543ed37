"""Issue 15.4: temp cleanup never deletes a save in flight in another PID namespace, on another host,
or from a reader; it still removes this host's dead writers' temporaries (and anyone's, once old)."""

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from lightning_resume.format import atomic
from lightning_resume.format.atomic import STALE_AFTER_S, clean_stale_temporaries, temp_name
from lightning_resume.io.plugin import SafetensorsCheckpointIO

DEAD_PID = 999_999_999  # beyond any pid_max: no such process here


def _dead_writer_temp(directory, monkeypatch, identity=None):
    """A temporary as a writer with ``DEAD_PID`` (and ``identity``, if given) would have named it."""
    with monkeypatch.context() as m:
        m.setattr(os, "getpid", lambda: DEAD_PID)
        if identity is not None:
            m.setattr(atomic, "_host_identity", lambda: identity, raising=False)
        path = directory / temp_name("last.ckpt")
    path.write_bytes(b"partial")
    return path


def test_in_flight_save_of_another_host_is_not_deleted(tmp_path, monkeypatch):
    other_host = _dead_writer_temp(tmp_path, monkeypatch, identity=("other-machine/eval-7", "other-boot", "pid:[1]"))
    assert clean_stale_temporaries(str(tmp_path)) == []
    assert other_host.exists()
    # once untouched for longer than any save, it is a leftover whoever wrote it
    old = time.time() - STALE_AFTER_S - 60
    os.utime(other_host, (old, old))
    assert clean_stale_temporaries(str(tmp_path)) == [str(other_host)]


def test_this_hosts_dead_writer_is_cleaned_at_once(tmp_path, monkeypatch):
    dead = _dead_writer_temp(tmp_path, monkeypatch)
    live = tmp_path / temp_name("y.ckpt")  # this process: a save in flight
    live.write_bytes(b"")
    assert clean_stale_temporaries(str(tmp_path)) == [str(dead)]
    assert live.exists()


def test_a_reader_never_cleans(tmp_path, monkeypatch):
    io = SafetensorsCheckpointIO()
    io.save_checkpoint({"global_step": 1, "w": torch.ones(2)}, str(tmp_path / "a.ckpt"))
    leftover = _dead_writer_temp(tmp_path, monkeypatch)
    SafetensorsCheckpointIO().load_checkpoint(str(tmp_path / "a.ckpt"))  # an eval job
    assert leftover.exists()


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--kill-child", "true"], capture_output=True)
    return probe.returncode == 0


WRITER = textwrap.dedent(
    """
    import os, sys, time
    from lightning_resume.format.atomic import temp_name
    alive_outside, directory = set(map(int, sys.argv[1].split(","))), sys.argv[2]
    while True:  # use up pids until this namespace hands out one that is free in the caller's
        pid = os.fork()
        if pid == 0:
            if os.getpid() in alive_outside:
                os._exit(3)
            path = os.path.join(directory, temp_name("last.ckpt"))
            with open(path, "wb") as f:
                f.write(b"partial")  # a save in flight: the writer is alive, in its own namespace
            print(path, os.getpid(), flush=True)
            time.sleep(120)
            os._exit(0)
        if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 3:
            break
    """
)


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare --pid (root or user namespaces)")
def test_in_flight_save_in_another_pid_namespace_is_not_deleted(tmp_path):
    alive = ",".join(n for n in os.listdir("/proc") if n.isdigit())
    writer = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", WRITER, alive, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )
    try:
        path, inner_pid = writer.stdout.readline().split()
        if atomic.pid_alive(int(inner_pid)):
            pytest.skip(f"pid {inner_pid} came alive here meanwhile; the attack needs it free")
        assert clean_stale_temporaries(str(tmp_path)) == []
        assert os.path.exists(path)
    finally:
        writer.kill()
        writer.wait()


def test_a_writer_cleans_each_directory_in_full_once_and_a_relative_one_again_after_a_chdir(tmp_path, monkeypatch):
    """The first save into a directory removes every stale temporary there; later saves remove only this host's
    dead writers' (issue 41, 9: no clock, no other owner judged again). A relative path names another directory
    after ``os.chdir``: cleaned in full too."""
    io = SafetensorsCheckpointIO()
    for d in ("a/ckpt", "b/ckpt"):
        (tmp_path / d).mkdir(parents=True)
    first = _dead_writer_temp(tmp_path / "a" / "ckpt", monkeypatch)
    io.save_checkpoint({"w": torch.ones(2)}, str(tmp_path / "a" / "ckpt" / "x.ckpt"))
    assert not first.exists()
    again = _dead_writer_temp(tmp_path / "a" / "ckpt", monkeypatch)
    other_host = _dead_writer_temp(tmp_path / "a" / "ckpt", monkeypatch, identity=("other", "boot", "pid:[1]"))
    old = time.time() - STALE_AFTER_S - 60
    os.utime(other_host, (old, old))
    io.save_checkpoint({"w": torch.ones(2)}, str(tmp_path / "a" / "ckpt" / "y.ckpt"))
    assert not again.exists(), "this host's dead writer's temporary goes at the next save"
    assert other_host.exists(), "another owner's is judged at the first save into a directory only"
    monkeypatch.chdir(tmp_path / "a")
    io.save_checkpoint({"w": torch.ones(2)}, "ckpt/z.ckpt")
    in_b = _dead_writer_temp(tmp_path / "b" / "ckpt", monkeypatch)
    monkeypatch.chdir(tmp_path / "b")
    io.save_checkpoint({"w": torch.ones(2)}, "ckpt/z.ckpt")
    assert not in_b.exists(), "the same relative parent names another directory now: cleaned"
