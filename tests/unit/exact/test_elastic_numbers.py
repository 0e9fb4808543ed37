"""An edited ``ExactResume`` state (world size, sample counts, rank entries, seeds) is refused before the restore
uses its numbers, with a typed error naming the field: never a raw ``ZeroDivisionError`` or ``ValueError``, and
never an epoch order built over 2**28 ranks or 5e7 samples first.

Each case edits a real checkpoint's state the way an attacker edits the file (load, change a number, save),
then resumes it through ``Trainer.fit(ckpt_path=...)`` in this process. A 2-rank checkpoint is made from a
1-rank one by giving it a second, alike rank entry, so that resuming it on this process's one rank is an
elastic resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch

from lightning_resume import CheckpointCorruptError, ExactResume, ResumeMismatchError
from lightning_resume.exact.state import elastic as policy
from tests.helpers.callbacks import SaveAt
from tests.helpers.jobs.trainee import Model
from tests.helpers.models import tiny_trainer

CFG = {"n": 200, "batch_size": 4, "distributed_sampler": True}


def _fit(tmp_path: Path, exact: ExactResume, callbacks=(), ckpt_path=None) -> pl.Trainer:
    trainer = tiny_trainer([exact, *callbacks], max_steps=6, enable_checkpointing=False, limit_val_batches=0)
    torch.manual_seed(0)
    trainer.fit(Model({"out": str(tmp_path), **CFG}), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint at step 3, inside the first epoch (50 batches), of a loader with a distributed sampler."""
    tmp = tmp_path_factory.mktemp("saved")
    path = tmp / "step3.ckpt"
    _fit(tmp, ExactResume(preemption=None), [SaveAt(path, 3)])
    return path


def _two_ranks(state: dict[str, Any]) -> None:
    """The state of a 2-rank run: rank 1's entry alike rank 0's (its sampler's arguments are the same)."""
    (rank,) = state["ranks"]
    state["ranks"] = [rank, dict(rank, rank=1)]
    state["world_size"] = 2


def _edited(saved: Path, tmp_path: Path, edit: Callable[[dict[str, Any]], Any]) -> str:
    checkpoint = torch.load(saved, weights_only=True)
    edit(checkpoint["callbacks"]["ExactResume"])
    path = tmp_path / "edited.ckpt"
    torch.save(checkpoint, path)
    return str(path)


@pytest.fixture
def no_epoch_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a saved epoch's order (the allocation the edited numbers size) fails the test."""

    def refused(*args: Any) -> Any:
        raise AssertionError("an epoch order was built from the edited numbers")

    monkeypatch.setattr(policy.OrderSpec, "indices", refused)
    monkeypatch.setattr(policy.OrderSpec, "every_rank", refused, raising=False)


def test_an_alike_two_rank_state_resumes_elastically(saved: Path, tmp_path: Path):
    """The harness: the edit that makes a 2-rank state resumes on one rank, every sample dealt."""
    exact = ExactResume(preemption=None, elastic=True)
    with pytest.warns(match="resumed a checkpoint of 2 ranks on 1"):
        _fit(tmp_path, exact, ckpt_path=_edited(saved, tmp_path, _two_ranks))
    report = exact.resume_report
    assert report.world_size == (2, 1) and report.sample_exact is True and report.untrained == 200 - 2 * 3 * 4


def test_a_huge_world_size_is_refused_before_any_order_is_built(saved: Path, tmp_path: Path, no_epoch_order):
    def edit(state: dict[str, Any]) -> None:
        _two_ranks(state)
        state["world_size"] = 2**28

    path = _edited(saved, tmp_path, edit)
    with pytest.raises(CheckpointCorruptError, match=r"world_size = 268435456: outside 1\.\.") as err:
        _fit(tmp_path, ExactResume(preemption=None, elastic=True), ckpt_path=path)
    assert err.value.path == path and "lightning-resume verify" in str(err.value)


def test_a_huge_sample_count_is_refused_before_any_order_is_built(saved: Path, tmp_path: Path, no_epoch_order):
    def edit(state: dict[str, Any]) -> None:
        _two_ranks(state)
        for rank in state["ranks"]:
            rank["orders"] = [dict(rank["orders"][0], length=50_000_000)]

    with pytest.raises(ResumeMismatchError, match=r"orders\[0\]\.length = 50000000.*train dataset has 200"):
        _fit(tmp_path, ExactResume(preemption=None, elastic=True), ckpt_path=_edited(saved, tmp_path, edit))


@pytest.mark.parametrize("elastic", [False, True])
def test_an_empty_rank_list_is_named(saved: Path, tmp_path: Path, elastic: bool):
    """The non-elastic restore too (it picks this rank's entry by a modulo of the list's length)."""
    path = _edited(saved, tmp_path, lambda state: state.update(ranks=[]))
    with pytest.raises(CheckpointCorruptError, match=r"ranks = an empty list: the state holds no rank's entry"):
        _fit(tmp_path, ExactResume(preemption=None, elastic=elastic), ckpt_path=path)


def _rank_order(rank: int, **changes: Any) -> Callable[[dict[str, Any]], None]:
    def edit(state: dict[str, Any]) -> None:
        _two_ranks(state)
        entry = state["ranks"][rank] = dict(state["ranks"][rank])
        entry["orders"] = [dict(entry["orders"][0], **changes)]

    return edit


def _set(**changes: Any) -> Callable[[dict[str, Any]], None]:
    def edit(state: dict[str, Any]) -> None:
        _two_ranks(state)
        state.update(changes)

    return edit


def _rank_entry(value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(state: dict[str, Any]) -> None:
        _two_ranks(state)
        state["ranks"][1] = value

    return edit


def _plan(indices: list[int], start: int = 0) -> Callable[[dict[str, Any]], None]:
    """An epoch a (forged) earlier elastic resume dealt, naming samples the dataset does not have."""

    def edit(state: dict[str, Any]) -> None:
        record = state["ranks"][0]["orders"][0]
        plan = {"epoch": record["epoch"], "indices": torch.tensor(indices, dtype=torch.int64), "start": start}
        state["ranks"][0]["orders"] = [dict(record, plan=plan)]

    return edit


def _batch_size(value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(state: dict[str, Any]) -> None:
        _two_ranks(state)
        state["signature"]["loaders"][0]["batch_size"] = value

    return edit


def _rng(stream: str, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(state: dict[str, Any]) -> None:
        rng = state["ranks"][0]["rng"]
        if key:
            rng[stream] = dict(rng[stream], **{key: value})
        else:
            rng[stream] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "elastic", "named"),
    [
        (_set(world_size=0), True, r"world_size = 0: outside 1\.\."),
        (_set(world_size=-2), True, r"world_size = -2: outside 1\.\."),
        (_set(world_size="2"), True, r"world_size = '2': not an integer"),
        (_set(world_size=3), True, r"world_size = 3: the state holds 2 rank entries"),
        (_set(accumulate=0), "keep_global_batch", r"accumulate = 0: outside 1\.\."),
        (_rank_entry(5), True, r"ranks\[1\] = 5: not a rank's state"),
        (_rank_order(0, length=-1), True, r"ranks\[0\]\.orders\[0\]\.length = -1: outside 0\.\."),
        (_rank_order(1, seed=2**70), True, r"ranks\[1\]\.orders\[0\]\.seed = 1180591620717411303424: outside"),
        (_rank_order(1, seed=11), True, r"ranks\[1\]\.orders\[0\]\.seed = 11: rank 0 saved 7"),
        (_rank_order(0, epoch="1"), True, r"ranks\[0\]\.orders\[0\]\.epoch = '1': not an integer"),
        (_plan([3, 10**9]), False, r"ranks\[0\]\.orders\[0\]\.plan\.indices: from 3 to 1000000000, not samples"),
        (_rng("torch", "", torch.zeros(10, dtype=torch.uint8)), False, r"ranks\[0\]\.rng\.torch = a tensor of shape"),
        (_rng("python", "state", torch.full((625,), 2**40)), False, r"ranks\[0\]\.rng\.python\.state = a tensor"),
        (_rng("numpy", "pos", 10**6), False, r"ranks\[0\]\.rng\.numpy: its pos"),
        (lambda state: state.update(captured_at=5), False, r"captured_at = 5: not a str"),
    ],
    ids=[
        "world-0", "world-negative", "world-str", "world-not-rank-count", "accumulate-0", "rank-entry-int",
        "length-negative", "seed-overflow", "seeds-differ", "epoch-str", "plan-out-of-range", "rng-torch-short",
        "rng-python-words", "rng-numpy-pos", "captured-at-int",
    ],
)  # fmt: skip
def test_an_edited_number_is_named_with_a_typed_error(saved: Path, tmp_path: Path, edit, elastic, named):
    path = _edited(saved, tmp_path, edit)
    with pytest.raises(CheckpointCorruptError, match=named) as err:
        _fit(tmp_path, ExactResume(preemption=None, elastic=elastic), ckpt_path=path)
    assert "its ExactResume state holds numbers no ExactResume writes" in str(err.value)


def test_every_rank_is_torchs_distributed_sampler_once():
    """The order of all ranks made once is each rank's ``DistributedSampler`` order (padding and drop_last too)."""
    for length, world, drop_last, shuffle in [(50, 3, False, True), (50, 3, True, True), (5, 8, False, False),
                                               (5, 8, True, True), (48, 4, True, False), (0, 2, False, True)]:  # fmt: skip
        spec = policy.OrderSpec(length, shuffle, 3, drop_last)
        assert spec.every_rank(world, 4) == [spec.indices(world, r, 4) for r in range(world)]


def test_a_batch_size_that_is_no_count_is_named_under_strict_false_too(saved: Path, tmp_path: Path):
    """``strict=False`` only warns that the signature differs, and the elastic deal then reads the batch size."""
    path = _edited(saved, tmp_path, _batch_size("x"))
    with pytest.raises(CheckpointCorruptError, match=r"signature\.loaders\[0\]\.batch_size = 'x': not an integer"):
        _fit(tmp_path, ExactResume(preemption=None, elastic=True, strict=False), ckpt_path=path)
