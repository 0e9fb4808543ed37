"""In-training replication between two real processes ("nodes" of one rank, a memory dir each) on gloo:
each node ends up holding the other's newest snapshot byte for byte; a replica that does not fit the holder
turns replication off with one warning naming the sizes and the fix, and the local snapshots stay."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_resume.memory.store import memory_root
from tests.helpers.paths import free_port, job_script
from tests.helpers.processes import start_preloaded

SLOT = "0123456789abcdef"


def _run(tmp_path: Path, mode: str) -> list[str]:
    port = free_port()
    ranks = [
        start_preloaded(job_script("replicate_job.py"), [r, port, tmp_path, mode], log=tmp_path / f"log{r}.txt")
        for r in (0, 1)
    ]
    for rank, proc in enumerate(ranks):
        assert proc.wait(180) == 0, (tmp_path / f"log{rank}.txt").read_text()[-3000:]
    return [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]


def _slot(tmp_path: Path, node: int) -> Path:
    return Path(memory_root(str(tmp_path / f"node{node}"))) / SLOT


@pytest.mark.multiprocess
@pytest.mark.extended  # in make test, tests/integration/test_memory_tier_replicate_fit.py checks this in a fit
def test_each_node_holds_the_others_newest_snapshot_byte_for_byte(tmp_path: Path) -> None:
    reports = _run(tmp_path, "ring")
    for rank, report in enumerate(reports):
        assert report.startswith("ended True enabled True"), report
        assert "last (" in report and ", 5, 5)" in report and "warning" not in report, report
    for node, other in ((0, 1), (1, 0)):
        own = (_slot(tmp_path, other) / f"rank-{other}-of-2.safetensors").read_bytes()
        assert (_slot(tmp_path, node) / f"replica-{other}-of-2.safetensors").read_bytes() == own


@pytest.mark.multiprocess
def test_a_replica_that_does_not_fit_turns_replication_off_with_one_warning(tmp_path: Path) -> None:
    other, owner = _run(tmp_path, "full")
    assert other.startswith("ended True enabled True"), other  # rank 1 has room: rank 0 still replicates
    assert owner.startswith("ended True enabled False"), owner
    warnings = [line for line in owner.splitlines() if line.startswith("warning")]
    assert len(warnings) == 1, owner
    assert "rank 1's replica" in warnings[0] and "does not fit the memory tier of rank 0 (1.0 KiB" in warnings[0]
    assert "replicas=0" in warnings[0] and "/dev/shm" in warnings[0]
    assert not (_slot(tmp_path, 0) / "replica-1-of-2.safetensors").exists()
    assert (_slot(tmp_path, 1) / "rank-1-of-2.safetensors").exists()  # the local tier kept every snapshot


@pytest.mark.multiprocess
def test_a_lost_peer_ends_replication_with_a_warning_and_nothing_hangs(tmp_path: Path) -> None:
    port = free_port()
    ranks = [
        start_preloaded(job_script("replicate_job.py"), [r, port, tmp_path, "killed"], log=tmp_path / f"log{r}.txt")
        for r in (0, 1)
    ]
    assert ranks[1].wait(180) == -9
    assert ranks[0].wait(180) == 0, (tmp_path / "log0.txt").read_text()[-3000:]
    report = (tmp_path / "rank0.txt").read_text()
    assert report.startswith("ended True enabled False"), report
    assert "rank 1" in report and "replication stopped" in report and "local memory tier stays on" in report, report
    assert (_slot(tmp_path, 0) / "rank-0-of-2.safetensors").exists()  # the local tier is whole
    assert (_slot(tmp_path, 0) / "replica-1-of-2.safetensors").exists()  # what arrived before the loss stays
