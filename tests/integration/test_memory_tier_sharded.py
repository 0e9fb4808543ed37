"""The memory tier under ``ShardedModelParallelStrategy`` (FSDP2 ``fully_shard`` on CPU/gloo, one node, 2 ranks,
dp=2), across real processes: each rank's memory snapshot is one file of its local shards (``sharded.local``).
Run B is SIGKILLed between durable saves (disk: the sharded directory of step 6; memory: step 8).

- A fresh ``fit(ckpt_path="last")`` resumes from memory at step 8, both ranks, bit for bit against the
  uninterrupted run A (every step's loss bits and samples, the whole gathered final state, ``prove``'s verdict).
- Rank 1's snapshot removed: both ranks resume from the durable directory of step 6, bit for bit.
- Relaunched on another mesh at the same world size (dp=1, tp=2): the snapshots' shards do not fit, said in one
  line naming a path, and the run resumes from the durable directory, which reshards.
- ``save="async"`` and tensor parallel (dp=1, tp=2) resume from memory too.

The first three share runs A and B (one module fixture)."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from lightning_resume.format.read import load_file
from lightning_resume.memory import store as memory_tier
from lightning_resume.schedule.options import DEFAULT_MEMORY_DIR
from tests.helpers import kill_resume as h

EXTENDED = frozenset(
    {
        "test_a_sharded_run_resumes_from_memory_exactly_at_the_newest_snapshot",
        "test_a_rank_without_its_snapshot_resumes_every_rank_from_disk_exactly",
        "test_another_mesh_is_refused_in_one_line_and_resumes_from_disk",
        "test_a_sharded_run_resumes_from_memory_exactly[async]",
        "test_a_sharded_run_resumes_from_memory_exactly[tp2]",
    }
)
"""In make test-all only: make test covers a sharded memory resume in test_memory_tier_replicas_sharded.py (rank 0
from its own memory, rank 1 from the peer's replica: the same snapshot, check and restore in place)."""

DURABLE_EVERY, MEMORY_EVERY, KILL_AT = 6, 2, 9
"""Durable snapshots every 6 steps, memory ones every 2: killed at step 9, disk has step 6, memory step 8."""

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]


def _cfg(tmp_path: Path, shm: Path, dp: int = 2, tp: int = 1, save: str = "sync") -> dict[str, Any]:
    memory = {"dir": str(shm), "every_n_train_steps_max": MEMORY_EVERY}
    exact = {"schedule": {"every_n_train_steps_max": DURABLE_EVERY}, "memory_tier": memory}
    return {
        "n": 80, "batch_size": 4, "max_epochs": 2, "dropout": 0.2, "augment": True, "shuffle": True,
        "devices": dp * tp, "sharded": {"dp": dp, "tp": tp}, "save": save, "ckpt": {"save_top_k": 0},
        "exact_args": exact, "ckpt_dir": str(tmp_path / "B" / "ckpt"), "flush_memory_tier": True,
        "env": {"PYTHONWARNINGS": "ignore"},
    }  # fmt: skip


def _snapshots(shm: Path) -> list[Path]:
    return sorted(shm.glob("*/*/rank-*.safetensors"))


def _memory_step(path: Path) -> int:
    return int(load_file(str(path)).checkpoint[memory_tier.MEMORY_KEY]["step"])


def _killed(workdir: Path, shm: Path, cfg: dict[str, Any]) -> Path:
    """Run A uninterrupted and B until it is killed at step ``KILL_AT``; B's state backed up."""
    h.uninterrupted(cfg, workdir)
    assert not _snapshots(shm), "a clean end of training frees the memory tier"
    h.run_until_paused(dict(cfg, out=str(workdir / "B"), pause_before=KILL_AT), workdir)
    assert [_memory_step(p) for p in _snapshots(shm)] == [8, 8]
    durable = sorted(p.name for p in Path(cfg["ckpt_dir"]).iterdir() if not p.name.startswith("."))
    assert durable == ["last-snapshot-step=000000006.ckpt"], f"one sharded directory, of step 6: {durable}"
    backup = workdir / "backup"
    shutil.copytree(shm, backup / "shm")
    shutil.copytree(cfg["ckpt_dir"], backup / "ckpt")
    return backup


class Killed:
    """Runs A and B of dp=2, once per module: their directory, B's config and the backup of B's state at the kill."""

    def __init__(self, workdir: Path, shm: Path) -> None:
        self.workdir, self.shm = workdir, shm
        self.cfg = _cfg(workdir, shm)
        self.backup = _killed(workdir, shm, self.cfg)

    def relaunch(self, name: str, **changes: Any) -> dict[str, Any]:
        """B's state put back as it was at the kill (a previous resume consumed it); run C's config, beside B (its
        trace continues B's: ``kill_resume.trace_dir``)."""
        shutil.rmtree(self.shm, ignore_errors=True)
        shutil.rmtree(self.cfg["ckpt_dir"], ignore_errors=True)
        shutil.copytree(self.backup / "shm", self.shm)
        shutil.copytree(self.backup / "ckpt", self.cfg["ckpt_dir"])
        return dict(self.cfg, out=str(self.workdir / name), resume="last", **changes)


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    shm = Path(DEFAULT_MEMORY_DIR) / f"lightning-resume-test-{uuid.uuid4().hex[:8]}"
    made: list[Killed] = []

    def runs() -> Killed:
        if not made:
            made.append(Killed(tmp_path_factory.mktemp("AB"), shm))
        return made[0]

    try:
        yield runs
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def _tiers(c: dict) -> list[tuple[str, int]]:
    reports = [json.loads((Path(c["out"]) / f"report-rank{r}.json").read_text()) for r in range(2)]
    return [(r["tier"], r["step"]) for r in reports]


def test_a_sharded_run_resumes_from_memory_exactly_at_the_newest_snapshot(killed) -> None:
    runs = killed()
    c = runs.relaunch("C_memory")
    h.run(c, runs.workdir)
    assert "resuming from the memory tier at step 8" in h.output(c, tail=None)
    assert _tiers(c) == [("memory", 8)] * 2
    assert not _snapshots(runs.shm), "freed at the clean end"
    h.assert_exact_resume(runs.workdir / "A", Path(c["out"]), resumed_after=8, ranks=2)


def test_a_rank_without_its_snapshot_resumes_every_rank_from_disk_exactly(killed) -> None:
    runs = killed()
    c = runs.relaunch("C_rank1_missing")
    next(runs.shm.glob("*/*/rank-1-of-2.safetensors")).unlink()
    h.run(c, runs.workdir)
    assert _tiers(c) == [("durable", 6)] * 2
    h.assert_exact_resume(runs.workdir / "A", Path(c["out"]), resumed_after=DURABLE_EVERY, ranks=2)


def test_another_mesh_is_refused_in_one_line_and_resumes_from_disk(killed) -> None:
    """dp=2 saved, dp=1 x tp=2 now: the same world size and file names, other shards; the durable directory
    reshards (what it trains from there is another run's: not compared with A). strict=False: ExactResume's own
    check refuses the resharded weights' fingerprint (other local shards), as it does without the memory tier."""
    runs = killed()
    c = runs.relaunch("C_mesh", sharded={"dp": 1, "tp": 2}, strict=False)
    h.run(c, runs.workdir)
    lines = [line for line in h.output(c, tail=None).splitlines() if "not resuming from the memory tier" in line]
    assert len(lines) == 1, lines
    assert "do not fit this run's sharding" in lines[0] and "rank 0: state_dict/" in lines[0], lines[0]
    assert lines[0].endswith("last-snapshot-step=000000006.ckpt"), lines[0]
    assert _tiers(c) == [("durable", 6)] * 2


@pytest.mark.parametrize(("save", "tp"), [("async", 1), ("sync", 2)], ids=["async", "tp2"])
def test_a_sharded_run_resumes_from_memory_exactly(tmp_path: Path, shm: Path, save: str, tp: int) -> None:
    cfg = _cfg(tmp_path, shm, dp=2 // tp, tp=tp, save=save)
    _killed(tmp_path, shm, cfg)
    c = dict(cfg, out=str(tmp_path / "C"), resume="last")
    h.run(c, tmp_path)
    assert _tiers(c) == [("memory", 8)] * 2
    h.assert_exact_resume(tmp_path / "A", Path(c["out"]), resumed_after=8, ranks=2)
