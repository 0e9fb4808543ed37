"""ExactResume(memory_tier=MemoryTierOptions()) in one process: a failed fit keeps its memory snapshot and the next
``fit(ckpt_path="last")`` resumes from it and says so; a clean end frees it; ``ckpt_path=None`` drops it."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import lightning
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_resume import ExactResume, MemoryTierOptions, SafetensorsCheckpointIO, ScheduleOptions
from tests.helpers.callbacks import CrashAt
from tests.helpers.models import TinyData, TinyMLP, TinyModel, tiny_trainer


def _fit(tmp_path: Path, shm: Path, ckpt_path, crash_at=None) -> ExactResume:
    lightning.seed_everything(0, verbose=False)
    exact = ExactResume(
        mtbf=None,
        schedule=ScheduleOptions(every_n_train_steps_max=6),
        memory_tier=MemoryTierOptions(dir=str(shm), every_n_train_steps_max=2),
    )
    callbacks = [exact, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=0)]
    callbacks += [CrashAt(crash_at)] if crash_at is not None else []
    trainer = tiny_trainer(callbacks, max_steps=12, limit_train_batches=4, plugins=[SafetensorsCheckpointIO()])
    trainer.fit(TinyModel(), datamodule=TinyData(), ckpt_path=ckpt_path)
    return exact


def test_defaults_pick_the_two_level_schedule() -> None:
    default = ExactResume(memory_tier=MemoryTierOptions()).scheduler
    assert default is not None and default.takes_memory_snapshots
    assert default.config.process_mtbf_s is not None  # "observed" with the 1 h prior
    capped = ExactResume(mtbf=None, memory_tier=MemoryTierOptions(every_n_train_steps_max=3)).scheduler
    assert capped is not None and capped.takes_memory_snapshots and capped.config.process_mtbf_s is None
    assert ExactResume(mtbf=None).memory is None


def test_crash_keeps_the_snapshot_and_last_resumes_from_memory(tmp_path: Path, shm: Path) -> None:
    with pytest.raises(RuntimeError, match="crash"):
        _fit(tmp_path, shm, ckpt_path="last", crash_at=9)
    assert len(list(shm.glob("*/*/rank-0-of-1.safetensors"))) == 1  # kept after the exception
    resumed = _fit(tmp_path, shm, ckpt_path="last")
    assert resumed.resume_report.tier == "memory" and resumed.resume_report.step == 8
    assert resumed.resume_report.exact and resumed.resume_report.fingerprint_ok
    assert not list(shm.glob("*/*/rank-*")), "a clean end frees the memory tier"


def test_a_fresh_start_drops_the_snapshot_of_another_line(tmp_path: Path, shm: Path) -> None:
    with pytest.raises(RuntimeError, match="crash"):
        _fit(tmp_path, shm, ckpt_path="last", crash_at=9)
    with pytest.raises(RuntimeError, match="crash"):
        _fit(tmp_path, shm, ckpt_path=None, crash_at=1)  # starts over: step 8's snapshot is not its own
    assert not list(shm.glob("*/*/rank-*.safetensors"))
    resumed = _fit(tmp_path, shm, ckpt_path="last")
    assert resumed.resume_report.tier != "memory"


def test_memory_options_come_from_lightning_cli_yaml() -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(ExactResume, "exact")
    init_args = {"mtbf": None, "memory_tier": {"process_mtbf": "1h", "dir": "/dev/shm/x", "every_n_train_steps_max": 5}}
    config = parser.parse_object({"exact": init_args})
    exact = parser.instantiate(config).exact if hasattr(parser, "instantiate") else None
    exact = exact or parser.instantiate_classes(config).exact
    assert exact.memory is not None and exact.memory.root == f"/dev/shm/x/lightning-resume-{os.geteuid()}"
    assert (
        exact.scheduler.config.process_mtbf_s == 3600.0 and exact.scheduler.config.memory_every_n_train_steps_max == 5
    )


def test_an_exception_lets_the_snapshot_being_written_commit(tmp_path: Path, shm: Path, monkeypatch) -> None:
    """A slow memory-tier write (step 8) still in flight when training raises at step 9 is committed before
    the exception leaves ``fit``: the relaunch resumes from step 8, not from the snapshot before it."""
    from lightning_resume.format import write

    commit = write.commit

    def slow_commit(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if path.startswith(str(shm)):  # the memory tier's writes only
            time.sleep(0.5)
        commit(path, *args, **kwargs)

    monkeypatch.setattr(write, "commit", slow_commit)
    with pytest.raises(RuntimeError, match="crash"):
        _fit(tmp_path, shm, ckpt_path="last", crash_at=9)
    monkeypatch.undo()
    resumed = _fit(tmp_path, shm, ckpt_path="last")
    assert resumed.resume_report.tier == "memory" and resumed.resume_report.step == 8


def _overlapped_fit(
    tmp_path: Path,
    shm: Path,
    crash_at=None,
    made: Optional[list] = None,
    overlap: bool = True,
    durable_every: int = 6,
    extra: tuple = (),
) -> tuple[ExactResume, dict]:
    """AdamW (state the optimizer writes, so the overlapped copy defers it), async saves on both tiers (overlapped
    with ``overlap``), durable every ``durable_every`` steps and memory every 2; the callback is appended to
    ``made`` before the fit (a crashing fit returns nothing)."""
    lightning.seed_everything(0, verbose=False)
    exact = ExactResume(
        mtbf=None,
        schedule=ScheduleOptions(every_n_train_steps_max=durable_every),
        memory_tier=MemoryTierOptions(dir=str(shm), every_n_train_steps_max=2),
    )
    if made is not None:
        made.append(exact)
    callbacks = [exact, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=0)]
    callbacks += [CrashAt(crash_at)] if crash_at is not None else []
    callbacks += list(extra)
    io = SafetensorsCheckpointIO(save="overlapped" if overlap else "async")
    trainer = tiny_trainer(callbacks, max_steps=12, plugins=[io], default_root_dir=str(tmp_path))
    model = TinyMLP()
    trainer.fit(model, ckpt_path="last")
    return exact, model.state_dict()


def test_with_overlap_copy_memory_snapshots_are_overlapped_and_resume_bitwise(tmp_path: Path, shm: Path) -> None:
    """``overlap_copy=True`` on the IO: the memory tier's snapshots defer the optimizer-written state to the
    copy thread too, and a crash resumed from one ends with the uninterrupted run's weights, bit for bit."""
    _, reference = _overlapped_fit(tmp_path / "a", shm / "a")
    made: list[ExactResume] = []
    with pytest.raises(RuntimeError, match="crash"):
        _overlapped_fit(tmp_path / "b", shm / "b", crash_at=9, made=made)
    store = made[0].memory.store if made[0].memory is not None else None
    copy = None if store is None else store.last_copy
    assert copy is not None and copy.deferred_bytes > 0 and not copy.recopied
    resumed, weights = _overlapped_fit(tmp_path / "b", shm / "b")
    assert resumed.resume_report.tier == "memory" and resumed.resume_report.step == 8
    assert resumed.resume_report.exact and resumed.resume_report.fingerprint_ok
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[k], reference[k]) for k in reference)


class WritesDoneBefore(Callback):
    """Waits for the IO's writes at the start of the batch that ends at ``step``: the schedule starts no durable
    save while one is in flight, so on a loaded machine the save at ``step`` would otherwise move."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.step - 1:
            trainer.strategy.checkpoint_io.wait()


def _lending_fit(tmp_path: Path, shm: Path, overlap: bool, crash_at=None, made: Optional[list] = None) -> dict:
    """Durable snapshots every 4 steps (step 8's made certain) and memory snapshots every 2: the memory snapshot
    at a durable step writes that save's staging."""
    extra = (WritesDoneBefore(8),)
    return _overlapped_fit(tmp_path, shm, crash_at, made, overlap=overlap, durable_every=4, extra=extra)[1]


@pytest.mark.parametrize("overlap", [False, True], ids=["async", "overlap_copy"])
def test_a_memory_snapshot_at_a_durable_step_writes_that_saves_staging_and_resumes_bitwise(
    tmp_path: Path, shm: Path, monkeypatch, overlap: bool
) -> None:
    """At step 8 the durable save stages the state and the memory snapshot writes those bytes, copying only what
    the durable dump does not hold; that durable write then fails (disk full), the run crashes at step 9, and the
    relaunch resumes from the borrowed memory snapshot at step 8 and ends with the uninterrupted run's weights."""
    reference = _lending_fit(tmp_path / "a", shm / "a", overlap)
    durable: list[str] = []
    commit = SafetensorsCheckpointIO._commit

    def second_durable_write_fails(self, path, tree_json, staged):  # type: ignore[no-untyped-def]
        durable.append(path)
        if len(durable) == 2:
            raise OSError(28, "No space left on device", path)
        commit(self, path, tree_json, staged)

    monkeypatch.setattr(SafetensorsCheckpointIO, "_commit", second_durable_write_fails)
    made: list[ExactResume] = []
    with pytest.raises(RuntimeError, match="crash"), pytest.warns(Warning):
        _lending_fit(tmp_path / "b", shm / "b", overlap, crash_at=9, made=made)
    monkeypatch.undo()
    memory = made[0].memory
    assert memory is not None and memory.store is not None and len(durable) == 2
    assert memory.borrowed_bytes > 0  # the step-8 snapshot took the durable save's staged tensors
    scheduler = made[0].scheduler
    assert scheduler is not None and scheduler.memory is not None
    assert len(scheduler.memory.costs) == 2  # C1 measured at steps 2 and 6 only: a borrowed snapshot costs no copy
    resumed: list[ExactResume] = []
    weights = _lending_fit(tmp_path / "b", shm / "b", overlap, made=resumed)
    report = resumed[0].resume_report
    assert report.tier == "memory" and report.step == 8 and report.exact and report.fingerprint_ok
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[k], reference[k]) for k in reference)
