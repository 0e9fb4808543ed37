"""A Lightning fit on two "nodes" of one rank (DDP on gloo over 127.0.0.1, a memory dir per node): with the
memory tier on, each rank's snapshots reach the other node (one replica by default on two nodes), byte for
byte the owner's file; a clean end frees both nodes' snapshots and replicas; an exception on one node ends
both processes as it does without replicas (no abort at exit from a transfer thread still waiting), the
snapshots kept for the relaunch."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.paths import free_port, job_script
from tests.helpers.processes import start, start_preloaded


def _two_nodes(tmp_path: Path, *args: object, interpreter: bool = False) -> list[int]:
    """Start both nodes of ``replica_fit_job.py`` and wait for them; their exit codes. ``interpreter``: each a new
    interpreter that exits as one does (finalization included), not a fork of the preloaded server."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    script, argv = job_script("replica_fit_job.py"), [tmp_path, *args]
    nodes = [
        start([script, *argv], {**env, "NODE_RANK": str(n)}, log=tmp_path / f"{n}.log")
        if interpreter
        else start_preloaded(script, argv, env={**env, "NODE_RANK": str(n)}, log=tmp_path / f"{n}.log")
        for n in (0, 1)
    ]
    return [proc.wait(300) for proc in nodes]


def _log(tmp_path: Path) -> str:
    return "\n".join((tmp_path / f"{n}.log").read_text()[-3000:] for n in (0, 1))


@pytest.mark.multiprocess
def test_each_node_holds_the_others_snapshot_during_a_fit(tmp_path: Path) -> None:
    assert _two_nodes(tmp_path) == [0, 0], _log(tmp_path)
    for rank in (0, 1):
        check = (tmp_path / f"check-rank{rank}.txt").read_text()
        assert check.startswith("replicas 1 same True seq 4 step 4"), check
        assert (tmp_path / f"end-rank{rank}.txt").read_text() == "left []"


@pytest.mark.multiprocess
def test_an_exception_on_one_node_ends_both_nodes_without_an_abort(tmp_path: Path) -> None:
    # rank 0 raises at step 5, rank 1 loses its peer; before, rank 0 ended in SIGABRT: its replica receiver still
    # waited in gloo when the interpreter finalized, and woke there as rank 1 went
    assert _two_nodes(tmp_path, 5, interpreter=True) == [1, 1], _log(tmp_path)
    assert "crash" in (tmp_path / "0.log").read_text() and "terminate called" not in _log(tmp_path)
    for node in (0, 1):  # the memory tier keeps what the relaunch resumes from
        assert [p.name for p in (tmp_path / f"node{node}").rglob("rank-*.safetensors")] == [
            f"rank-{node}-of-2.safetensors"
        ]
