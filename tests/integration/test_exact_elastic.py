"""Elastic resume, killed mid-epoch and resumed in fresh processes on another number of ranks (DDP on gloo):
over the interrupted epoch every sample id is trained exactly once (a stated few repeated to give every rank
as many), the next epoch follows the sampler's order for the new world size, the same elastic resume twice is
bitwise the same run, ``keep_global_batch`` scales accumulation, and what cannot be dealt out is refused.

The runs are what users write: a plain ``DataLoader(shuffle=True, num_workers=2)`` and Lightning's own
distributed sampler (``use_distributed_sampler=True``), dropout, 96 samples in batches of 4."""

from __future__ import annotations

import json
import shutil
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_resume.schedule.options import DEFAULT_MEMORY_DIR
from tests.helpers import kill_resume as h
from tests.helpers.compare import assert_bitwise

N, BATCH = 96, 4
CFG: dict[str, Any] = {
    "n": N,
    "batch_size": BATCH,
    "max_epochs": 3,
    "dropout": 0.2,
    "shuffle": True,
    "pipeline": "plain",
    "use_distributed_sampler": True,
    "num_workers": 2,
    "ckpt": {"every_n_train_steps": 4, "save_top_k": -1, "filename": "{step}"},
    "exact_args": {"elastic": True},
    "val_check_interval": 1.0,  # a validation at each epoch's end: the dealt epoch must end where it validates
    "record_validation": True,
}
EXTENDED = frozenset(
    {
        "test_a_kill_inside_the_dealt_epoch_resumes_exactly_or_is_dealt_again",
        "test_an_interrupted_epoch_is_trained_once_on_another_world_size[2_to_1]",
        "test_one_rank_to_two",
        "test_an_iterable_dataset_is_refused",
        "test_with_the_memory_tier_a_changed_world_size_resumes_from_disk",
    }
)
"""In make test-all only: 2 -> 1 is also what keep_global_batch and the determinism test resume; 1 -> 2, the
iterable refusal and the memory tier are their own paths, each a few fresh processes."""
SAVED_STEP = 16
"""The checkpoint resumed from: on 2 ranks an epoch is 12 steps, so step 16 is 4 batches into epoch 1."""


def _launch(root: Path, name: str, devices: int, **extra: Any) -> dict[str, Any]:
    cfg = dict(CFG, devices=devices, out=str(root / name), ckpt_dir=str(root / f"ckpt-{name}"), **extra)
    if devices == 1:
        cfg["ddp"] = {}  # one DDP process, as torchrun starts it, with Lightning's distributed sampler
    return cfg


@pytest.fixture(scope="module")
def killed_on_two(tmp_path_factory) -> Path:
    """A 2-rank run SIGKILLed in epoch 1, after its checkpoint at step 16."""
    root = tmp_path_factory.mktemp("elastic")
    h.run_until_paused(dict(_launch(root, "B", 2), pause_before=SAVED_STEP + 2), root)
    assert (root / "ckpt-B" / f"step={SAVED_STEP}.ckpt").exists()
    return root


def _ids(out: Path, ranks: int, epoch: int, keep=lambda record: True) -> list[int]:
    return [
        i for r in range(ranks) for s in h.steps(out, r) if "ids" in s and s["epoch"] == epoch and keep(s)
        for i in s["ids"]
    ]  # fmt: skip


def _before_save(out: Path, ranks: int, epoch: int, step: int) -> list[int]:
    """The ids the killed run trained in ``epoch`` before its checkpoint at ``step``."""
    return _ids(out, ranks, epoch, lambda s: s["step"] < step)


def _report(out: Path, rank: int = 0) -> dict[str, Any]:
    return json.loads((Path(out) / f"report-rank{rank}.json").read_text())


def _resume(root: Path, name: str, devices: int, ckpt: Path, **extra: Any) -> dict[str, Any]:
    cfg = dict(_launch(root, name, devices, **extra), resume=str(ckpt))
    h.run(cfg, root, timeout=300)
    return cfg


def _assert_epoch_once(before: list[int], after: list[int], repeated: int = 0) -> None:
    counts = Counter(before + after)
    assert set(counts) == set(range(N)), f"never trained: {sorted(set(range(N)) - set(counts))}"
    twice = sorted(i for i, c in counts.items() if c > 1)
    assert len(twice) == repeated and all(counts[i] == 2 for i in twice), f"trained twice: {twice}"


@pytest.mark.parametrize("devices", [1, 3], ids=["2_to_1", "2_to_3"])
def test_an_interrupted_epoch_is_trained_once_on_another_world_size(
    killed_on_two: Path, tmp_path: Path, devices: int
) -> None:
    ckpt = killed_on_two / "ckpt-B" / f"step={SAVED_STEP}.ckpt"
    c = _resume(tmp_path, "C", devices, ckpt)
    before = _before_save(killed_on_two / "B", 2, 1, SAVED_STEP)
    assert len(before) == 2 * 4 * BATCH
    after = _ids(Path(c["out"]), devices, 1)
    untrained = N - len(before)
    repeated = -untrained % devices  # DistributedSampler's rule: padded to a multiple of the world size
    _assert_epoch_once(before, after, repeated)
    report = _report(Path(c["out"]))
    assert report["exact"] is False and report["sample_exact"] is True
    assert report["world_size"] == {"checkpoint": 2, "now": devices}
    assert report["global_batch"] == {"before": 2 * BATCH, "after": devices * BATCH}
    assert report["untrained"] == untrained and report["repeated"] == repeated
    out = h.output(c, tail=None)
    assert out.count("ExactResume(elastic=True): resumed a checkpoint of 2 ranks on") == 1
    # The next epoch: the sampler's ordinary order for the new world size, every sample once, ranks disjoint.
    assert sorted(_ids(Path(c["out"]), devices, 2)) == list(range(N))
    # The resumed run goes on counting steps where the killed one stopped, and saves under the same names.
    first = min(s["step"] for r in range(devices) for s in h.steps(Path(c["out"]), r))
    assert first == SAVED_STEP
    # The dealt epoch ends after its last batch, with its validation there and nowhere else.
    records = h.steps(Path(c["out"]))
    last_train = max(i for i, s in enumerate(records) if "ids" in s and s["epoch"] == 1)
    validations = [i for i, s in enumerate(records) if "val" in s and s["epoch"] == 1]
    assert validations and validations == list(range(last_train + 1, last_train + 1 + len(validations)))


def test_one_rank_to_two(tmp_path: Path) -> None:
    """1 -> 2: a one-process DDP run (Lightning's sampler for one replica, around a ``StatefulDataLoader``,
    which Lightning rebuilds with a batch sampler) killed in epoch 1, resumed on 2 with another ``num_workers``."""
    b = _launch(tmp_path, "B", 1, pause_before=24 + 6, pipeline="stock")  # an epoch is 24 steps on one rank
    h.run_until_paused(b, tmp_path)
    ckpt = tmp_path / "ckpt-B" / "step=28.ckpt"
    c = _resume(tmp_path, "C", 2, ckpt, num_workers=0, pipeline="stock")  # workers may change: dealt anew
    before = _before_save(Path(b["out"]), 1, 1, 28)
    assert len(before) == 4 * BATCH
    _assert_epoch_once(before, _ids(Path(c["out"]), 2, 1))
    assert sorted(_ids(Path(c["out"]), 2, 2)) == list(range(N))
    assert _report(Path(c["out"]), 1)["world_size"] == {"checkpoint": 1, "now": 2}


@pytest.fixture(scope="module")
def dealt_on_one(killed_on_two: Path) -> Path:
    """The 2-rank checkpoint resumed on one rank, uninterrupted to the end: ``<root>/C1``."""
    _resume(killed_on_two, "C1", 1, killed_on_two / "ckpt-B" / f"step={SAVED_STEP}.ckpt")
    return killed_on_two / "C1"


def _final(out: Path) -> dict[str, Any]:
    return torch.load(Path(out) / "final.pt", weights_only=True)


def test_the_same_elastic_resume_twice_is_the_same_run(killed_on_two: Path, dealt_on_one: Path, tmp_path: Path):
    second = _resume(tmp_path, "C2", 1, killed_on_two / "ckpt-B" / f"step={SAVED_STEP}.ckpt")
    a, b = h.steps(dealt_on_one), h.steps(Path(second["out"]))
    assert len(a) > 0 and a == b  # ids and loss bits of every step
    assert_bitwise(_final(dealt_on_one), _final(Path(second["out"])), "final")


def test_a_kill_inside_the_dealt_epoch_resumes_exactly_or_is_dealt_again(
    killed_on_two: Path, dealt_on_one: Path, tmp_path: Path
) -> None:
    """The one-rank run killed inside the epoch it was dealt: on one rank again it resumes bitwise (the plan
    goes back on the sampler); on two it is dealt out again, from the plan, still every sample once."""
    ckpt = killed_on_two / "ckpt-B" / f"step={SAVED_STEP}.ckpt"
    killed = dict(_launch(tmp_path, "K", 1, pause_before=6), resume=str(ckpt))  # killed after step 21
    h.run_until_paused(killed, tmp_path)
    second_ckpt = Path(killed["ckpt_dir"]) / "step=20.ckpt"
    again = _resume(tmp_path, "D", 1, second_ckpt)
    assert h.steps(Path(again["out"])) == [s for s in h.steps(dealt_on_one) if s["step"] >= 20]
    assert_bitwise(_final(dealt_on_one), _final(Path(again["out"])), "final")
    assert _report(Path(again["out"]))["exact"] is True
    wider = _resume(tmp_path, "E", 2, second_ckpt)
    before = _before_save(killed_on_two / "B", 2, 1, SAVED_STEP) + _before_save(Path(killed["out"]), 1, 1, 20)
    assert len(before) == 2 * 4 * BATCH + 4 * BATCH
    _assert_epoch_once(before, _ids(Path(wider["out"]), 2, 1))
    assert sorted(_ids(Path(wider["out"]), 2, 2)) == list(range(N))


def test_keep_global_batch_doubles_accumulation_on_half_the_ranks(killed_on_two: Path, tmp_path: Path) -> None:
    ckpt = killed_on_two / "ckpt-B" / f"step={SAVED_STEP}.ckpt"
    c = _resume(tmp_path, "C", 1, ckpt, exact_args={"elastic": "keep_global_batch"}, max_epochs=2)
    report = _report(Path(c["out"]))
    assert report["accumulate_grad_batches"] == {"before": 1, "after": 2}
    assert report["global_batch"] == {"before": 8, "after": 8} and report["accumulate_grad_batches_now"] == 2
    records = [s for s in h.steps(Path(c["out"])) if "ids" in s]
    assert len(records) * BATCH == N - 2 * 4 * BATCH  # epoch 1's rest, in batches of 4 on one rank
    steps = [s["step"] for s in records]
    assert steps == [SAVED_STEP + i // 2 for i in range(len(steps))]  # one optimizer step per two batches
    final = torch.load(Path(c["out"]) / "final.pt", weights_only=True)
    assert final["global_step"] == SAVED_STEP + 8  # the same step count the 2-rank run would have reached


def test_without_elastic_a_changed_world_size_is_refused_naming_the_option(killed_on_two: Path, tmp_path: Path) -> None:
    c = dict(_launch(tmp_path, "C", 1), exact_args={}, resume=str(killed_on_two / "ckpt-B" / f"step={SAVED_STEP}.ckpt"))
    assert h.exit_code(c, tmp_path) != 0
    out = h.output(c)
    assert "ResumeMismatchError" in out and "checkpoint written by 2 processes, this run has 1" in out
    assert "ExactResume(elastic=True)" in out


def test_an_iterable_dataset_is_refused(tmp_path: Path) -> None:
    """A stream's position cannot be dealt to other ranks: refused before anything is trained."""
    cfg = dict(_launch(tmp_path, "B", 2), iterable=True, pause_before=6, num_workers=0)
    cfg["ckpt"] = {"every_n_train_steps": 2, "save_top_k": -1, "filename": "{step}"}
    h.run_until_paused(cfg, tmp_path)
    c = dict(_launch(tmp_path, "C", 1), iterable=True, num_workers=0, resume=str(tmp_path / "ckpt-B" / "step=4.ckpt"))
    assert h.exit_code(c, tmp_path) != 0
    out = h.output(c)
    assert "ResumeMismatchError" in out and "cannot be dealt to other ranks" in out
    assert not h.steps(Path(c["out"]))  # nothing trained


def test_with_the_memory_tier_a_changed_world_size_resumes_from_disk(tmp_path: Path) -> None:
    """Memory snapshots are per rank of the old world size: every new rank resumes from disk, named in the report."""
    shm = Path(DEFAULT_MEMORY_DIR) / f"lightning-resume-test-{uuid.uuid4().hex[:8]}"
    memory = {"dir": str(shm), "every_n_train_steps_max": 2}
    exact = {"elastic": True, "schedule": {"every_n_train_steps_max": 6}, "memory_tier": memory}
    cfg = {
        "n": 80, "batch_size": 4, "max_epochs": 2, "dropout": 0.2, "shuffle": True, "distributed_sampler": True,
        "safetensors": True, "ckpt": {"save_top_k": 0}, "exact_args": exact, "ckpt_dir": str(tmp_path / "ckpt"),
        "flush_memory_tier": True,
    }  # fmt: skip
    try:
        b = dict(cfg, devices=2, out=str(tmp_path / "B"), pause_before=9)  # disk: step 6; memory: step 8
        h.run_until_paused(b, tmp_path)
        assert len(list(shm.glob("*/*/rank-*-of-2.safetensors"))) == 2
        c = dict(cfg, devices=1, ddp={}, out=str(tmp_path / "C"), resume="last")
        h.run(c, tmp_path)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    report = _report(Path(c["out"]))
    assert report["tier"] == "durable" and report["memory_tier"] == "snapshots of 2 ranks not used: resumed from disk"
    before = _before_save(Path(b["out"]), 2, 0, 6)
    assert len(before) == 2 * 6 * 4
    counts = Counter(before + _ids(Path(c["out"]), 1, 0))
    assert counts == Counter(range(80))


def test_a_validation_due_after_the_saved_step_runs_on_the_new_world_size(tmp_path: Path) -> None:
    """Validation every 4 batches and a checkpoint every 4 steps: the one at step 16 was written before the
    validation due right after it, which Lightning skips on resume; the elastic resume runs it first."""
    b = _launch(tmp_path, "B", 2, val_check_interval=4, pause_before=SAVED_STEP + 2)
    h.run_until_paused(b, tmp_path)
    killed = h.steps(Path(b["out"]))
    after_save = [s for s in killed if s["step"] == SAVED_STEP]
    assert "val" in after_save[0]  # the uninterrupted order: the validation, then the next batch
    c = _resume(tmp_path, "C", 1, tmp_path / "ckpt-B" / f"step={SAVED_STEP}.ckpt", val_check_interval=4)
    records = h.steps(Path(c["out"]))
    assert [("val" in s, s["step"]) for s in records[:2]] == [(True, SAVED_STEP), (True, SAVED_STEP)]
    assert "ids" in records[2] and records[2]["step"] == SAVED_STEP
