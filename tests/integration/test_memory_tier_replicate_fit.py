"""A Lightning fit on two "nodes" of one or two ranks (DDP on gloo over 127.0.0.1, a memory dir per node): with the
memory tier on, each rank's snapshots reach the other node (one replica by default on two nodes), byte for
byte the owner's file; a clean end frees both nodes' snapshots and replicas; an exception on one node ends
both processes as it does without replicas (no abort at exit from a transfer thread still waiting), the
snapshots kept for the relaunch."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.paths import free_port, job_script
from tests.helpers.processes import start, start_preloaded


def _two_nodes(tmp_path: Path, per_node: int = 1, *args: object, interpreter: bool = False) -> list[int]:
    """Start every rank of both nodes of ``replica_fit_job.py`` (by rank) and wait for them; their exit codes.
    ``interpreter``: each a new interpreter that exits as one does (finalization included), not a fork of the
    preloaded server."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(2 * per_node)}
    script, argv = job_script("replica_fit_job.py"), [tmp_path, per_node, *args]
    procs = []
    for rank in range(2 * per_node):
        node, local = divmod(rank, per_node)
        rank_env, log = {**env, "NODE_RANK": str(node), "LOCAL_RANK": str(local)}, tmp_path / f"{rank}.log"
        procs.append(
            start([script, *argv], rank_env, log=log)
            if interpreter
            else start_preloaded(script, argv, env=rank_env, log=log)
        )
    return [proc.wait(300) for proc in procs]


def _log(tmp_path: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(tmp_path.glob("*.log")))


@pytest.mark.multiprocess
@pytest.mark.parametrize("per_node", [1, pytest.param(2, marks=pytest.mark.extended)])
def test_each_node_holds_the_others_snapshot_during_a_fit(tmp_path: Path, per_node: int) -> None:
    world = 2 * per_node
    assert _two_nodes(tmp_path, per_node) == [0] * world, _log(tmp_path)
    for rank in range(world):
        check = (tmp_path / f"check-rank{rank}.txt").read_text()  # the same local rank on the other node
        assert check.startswith(f"replicas 1 of {(rank + per_node) % world} same True seq 4 step 4"), check
    assert [p.name for p in tmp_path.glob("node*/**/*") if p.is_file()] == []  # a clean end freed them all


@pytest.mark.multiprocess
def test_an_exception_on_one_node_ends_both_nodes_without_an_abort(tmp_path: Path) -> None:
    # rank 0 raises at step 5, rank 1 loses its peer; before, rank 0 ended in SIGABRT: its replica receiver still
    # waited in gloo when the interpreter finalized, and woke there as rank 1 went
    assert _two_nodes(tmp_path, 1, 5, interpreter=True) == [1, 1], _log(tmp_path)
    assert "crash" in (tmp_path / "0.log").read_text() and "terminate called" not in _log(tmp_path)
    for node in (0, 1):  # the memory tier keeps what the relaunch resumes from (and the saves it keeps)
        assert [p.name for p in (tmp_path / f"node{node}").rglob("rank-*-of-2.safetensors")] == [
            f"rank-{node}-of-2.safetensors"
        ]
