"""``memory.transport`` between two real processes on a gloo group of 127.0.0.1: a file arrives byte for byte
in bounded chunks, a sink that refuses or fails leaves the stream in step, and "nothing" reads as ``None``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.paths import free_port, job_script
from tests.helpers.processes import start_preloaded


@pytest.mark.multiprocess
def test_a_file_goes_to_a_peer_byte_for_byte_and_nothing_reads_as_none(tmp_path: Path) -> None:
    payload = os.urandom(10_007)  # ten full chunks of 1000 bytes and a short one
    (tmp_path / "source.bin").write_bytes(payload)
    port = free_port()
    ranks = [
        start_preloaded(job_script("transfer_job.py"), [rank, port, tmp_path], log=tmp_path / f"rank{rank}.log")
        for rank in (0, 1)
    ]
    for rank, proc in enumerate(ranks):
        code = proc.wait(120)
        assert code == 0, (tmp_path / f"rank{rank}.log").read_text()[-3000:]
    assert (tmp_path / "received.bin").read_bytes() == payload
    assert (tmp_path / "rank0.txt").read_text() == "10007 10007 10007"
    assert (tmp_path / "rank1.txt").read_text().splitlines() == [
        "refused 10007 record (11, 7)",
        "kept 10007 record (12, 7)",
        "['refused', 'kept', 'the sink failed after one chunk', None]",
    ]
