"""A Lightning fit on two "nodes" of one rank (DDP on gloo over 127.0.0.1, a memory dir per node): with the
memory tier on, each rank's snapshots reach the other node (one replica by default on two nodes), byte for
byte the owner's file; a clean end frees both nodes' snapshots and replicas."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.paths import free_port, job_script
from tests.helpers.processes import start_preloaded


@pytest.mark.multiprocess
def test_each_node_holds_the_others_snapshot_during_a_fit(tmp_path: Path) -> None:
    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    nodes = [
        start_preloaded(
            job_script("replica_fit_job.py"), [tmp_path], env={**env, "NODE_RANK": str(n)}, log=tmp_path / f"{n}.log"
        )
        for n in (0, 1)
    ]
    for n, proc in enumerate(nodes):
        assert proc.wait(300) == 0, (tmp_path / f"{n}.log").read_text()[-4000:]
    for rank in (0, 1):
        check = (tmp_path / f"check-rank{rank}.txt").read_text()
        assert check.startswith("replicas 1 same True seq 4 step 4"), check
        assert (tmp_path / f"end-rank{rank}.txt").read_text() == "left []"
