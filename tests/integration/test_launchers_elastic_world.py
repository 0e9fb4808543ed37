"""torchelastic membership change: ``torchrun --nnodes 1:2`` on two "nodes" (two agents on loopback, one process
each), ``ExactResume(elastic=True)``, checkpoints every 2 steps to a shared directory. Once the run has saved
in the middle of epoch 1, one node goes away: its agent and its worker are SIGKILLed. The surviving agent's
worker fails on its next collective, the agent restarts it (``--max-restarts``), re-rendezvouses with the one
node left once the dead node's keep-alive has expired, and the restarted worker resumes ``fit(ckpt_path=
"last")`` on world size 1 from the checkpoint the 2 ranks wrote: the samples of epoch 1 that no rank had
trained by that checkpoint are trained once on the survivor, and the run finishes.

Launch: every agent runs the same line but for ``is_host`` (only the node kept holds the rendezvous store,
which must outlive the other) with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (see test_launchers_torchrun.py).
torchrun starts each worker in a session of its own, so a node's death is the agent's group and its workers'.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.kill_resume import steps
from tests.helpers.paths import REPO_ROOT, free_port, job_script
from tests.helpers.processes import log_tail

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="finds torchrun's workers in /proc; gloo on interface lo"),
]

N, BATCH = 48, 4
SAVED = 8
"""On 2 ranks an epoch is 48 / 2 / 4 = 6 steps: the checkpoint of step 8 is 2 batches into epoch 1."""
PAUSE = SAVED + 1
"""Both ranks wait at the start of step 9's batch: the batch after the checkpoint was trained, and is lost."""
CFG: dict[str, Any] = {
    "n": N,
    "batch_size": BATCH,
    "max_epochs": 3,
    "dropout": 0.2,
    "augment": True,
    "shuffle": True,
    "pipeline": "plain",  # a plain DataLoader(shuffle=True) under Lightning's own distributed sampler
    "use_distributed_sampler": True,
    "elastic": True,
    "world_from_launcher": True,
    "tag_records": True,
    "ckpt_every": 2,
    "save_top_k": -1,
    "ckpt_filename": "{epoch}-{step}",
    "pause_at": PAUSE,
}
RDZV_CONF = "join_timeout=60,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"
"""Fast membership change: a node without a heartbeat for 3 s is dead; a round with fewer than 2 nodes closes
2 s after the first joined (so both nodes must join the first round within 2 s of each other)."""

EXTENDED = frozenset({"test_a_node_gone_the_survivor_rendezvouses_alone_and_trains_the_rest_of_the_epoch_once"})
"""In make test-all: two torchrun agents (the DDP deal itself is in make test)."""


def agent(cfg: dict, tmp_path: Path, endpoint: str, node: int, is_host: bool) -> subprocess.Popen:
    """Node ``node``'s torchrun agent, in a session of its own; its output in ``node-<node>.log``."""
    cfg_path = tmp_path / f"node-{node}.json"
    cfg_path.write_text(json.dumps(cfg))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
        "--max-restarts", "2", "--monitor-interval", "0.1", "--rdzv-backend", "c10d", "--rdzv-id", "elastic-world",
        "--rdzv-endpoint", endpoint, "--rdzv-conf", f"{RDZV_CONF},is_host={int(is_host)}",
        "--local-addr", "127.0.0.1", job_script("elastic_job.py"), str(cfg_path),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env["GLOO_SOCKET_IFNAME"] = "lo"  # the process group on loopback, whatever the host name resolves to
    with open(tmp_path / f"node-{node}.log", "w") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from ``/proc``: torchrun's workers are in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        out += below
        todo += below
    return out


def kill_node(proc: subprocess.Popen) -> list[int]:
    """The node is gone: SIGKILL its agent's process group and every worker session below it; the workers'
    pids."""
    workers = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in workers:
        try:
            os.killpg(pid, signal.SIGKILL)  # a worker leads its own session (and its data workers, if any)
        except ProcessLookupError:
            pass
    proc.wait(timeout=120)
    return workers


def wait_for(ready, timeout: float, procs: list[subprocess.Popen], tmp_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert all(p.poll() is None for p in procs), f"an agent exited early:\n{log_tail(tmp_path, 'node')}"
        assert time.monotonic() < deadline, f"timed out:\n{log_tail(tmp_path, 'node')}"
        time.sleep(0.05)


def records(out: Path, rank: int, **match: Any) -> list[dict]:
    return [r for r in steps(out, rank) if all(r[k] == v for k, v in match.items())]


def ids(recs: list[dict]) -> list[int]:
    return [i for r in recs for i in r["ids"]]


def reports(out: Path, rank: int) -> dict[int, dict]:
    """``{restart count: the report of that attempt}`` for rank ``rank``."""
    found = {}
    for path in out.glob(f"report-rank{rank}-attempt*.json"):
        found[int(path.stem.rsplit("attempt", 1)[1])] = json.loads(path.read_text())
    return found


def test_a_node_gone_the_survivor_rendezvouses_alone_and_trains_the_rest_of_the_epoch_once(tmp_path: Path) -> None:
    out, ckpt_dir = tmp_path / "out", tmp_path / "ckpt"
    cfg = dict(CFG, out=str(out), ckpt_dir=str(ckpt_dir))
    endpoint = f"127.0.0.1:{free_port()}"
    survivor = agent(cfg, tmp_path, endpoint, node=0, is_host=True)
    doomed = agent(cfg, tmp_path, endpoint, node=1, is_host=False)
    try:
        both_paused = lambda: all((out / f"paused-rank{r}").exists() for r in (0, 1))
        wait_for(both_paused, 120, [survivor, doomed], tmp_path)
        assert (ckpt_dir / f"epoch=1-step={SAVED}.ckpt").exists(), sorted(p.name for p in ckpt_dir.iterdir())
        paused = {rank: json.loads((out / f"paused-rank{rank}").read_text()) for rank in (0, 1)}
        assert [p["world"] for p in paused.values()] == [2, 2], paused
        [doomed_worker] = kill_node(doomed)
        assert doomed_worker in [p["pid"] for p in paused.values()], (paused, doomed_worker)
        (out / "release").write_text("")  # the survivor's worker goes on, to its next collective
        assert survivor.wait(timeout=120) == 0, log_tail(tmp_path, "node")
    finally:
        for proc in (survivor, doomed):
            if proc.poll() is None:
                kill_node(proc)
    assert doomed.returncode == -signal.SIGKILL
    log = (tmp_path / "node-0.log").read_text()
    assert "ExactResume(elastic=True): resumed a checkpoint of 2 ranks on 1" in log, log_tail(tmp_path, "node")

    # The first attempt ran on both nodes; the last attempt of the survivor on 1, from the 2 ranks' checkpoint.
    first = {rank: reports(out, rank)[0] for rank in (0, 1)}
    assert all(r["world_size_now"] == 2 and r["source"] is None for r in first.values()), first
    rank0_reports = reports(out, 0)  # attempt 0: whichever node had rank 0; then the survivor's attempts
    last = rank0_reports[max(rank0_reports)]
    assert max(rank0_reports) >= 1 and last["world_size_now"] == 1, rank0_reports
    assert last["world_size"] == {"checkpoint": 2, "now": 1} and last["step"] == SAVED, last
    assert Path(last["source"]).name == "last.ckpt", last
    assert last["sample_exact"] is True and last["exact"] is False, last
    assert last["untrained"] == N - 2 * 2 * BATCH and last["repeated"] == 0 and last["dropped"] == 0, last
    worlds = [rank0_reports[a]["world_size_now"] for a in sorted(rank0_reports)]
    assert worlds == [2] * (len(worlds) - 1) + [1], rank0_reports  # no 1-node attempt before the other left
    finished = [json.loads(line) for line in (out / "attempts-rank0.jsonl").read_text().splitlines()]
    assert [(a["world_size"], a["resumed_from"]) for a in finished] == [(1, SAVED)], finished
    assert not (out / "attempts-rank1.jsonl").exists(), "no 2-rank attempt finished"
    assert (out / "final.pt").exists()

    # Epoch 1: what the 2 ranks trained before the checkpoint, plus what the survivor trained: every id once.
    two = [r for rank in (0, 1) for r in records(out, rank, world=2)]
    before = ids([r for r in two if r["epoch"] == 1 and r["step"] < SAVED])
    assert len(before) == 2 * 2 * BATCH
    # Trained after the checkpoint, then lost: step 8's batch on both ranks, and the survivor's forward of step
    # 9's (its backward's all-reduce found the other rank gone).
    doomed_rank = next(rank for rank, p in paused.items() if p["pid"] == doomed_worker)
    lost = {rank: [r["step"] for r in records(out, rank, world=2) if r["step"] >= SAVED] for rank in (0, 1)}
    assert lost[doomed_rank] == [SAVED] and lost[1 - doomed_rank] in ([SAVED], [SAVED, SAVED + 1]), lost
    one = records(out, 0, world=1)
    after = ids([r for r in one if r["epoch"] == 1])
    counts = Counter(before + after)
    assert set(counts) == set(range(N)), f"never trained: {sorted(set(range(N)) - set(counts))}"
    assert max(counts.values()) == 1, f"trained twice: {sorted(i for i, c in counts.items() if c > 1)}"
    # The survivor counts steps on from the checkpoint; epoch 2 is the sampler's order on 1 rank, every id once.
    assert [r["step"] for r in one] == list(range(SAVED, SAVED + len(one)))
    assert sorted(ids([r for r in one if r["epoch"] == 2])) == list(range(N))
    assert {r["restart"] for r in one} == {max(rank0_reports)}
