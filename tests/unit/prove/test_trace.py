"""The trace ``ExactResume`` writes for ``lightning-resume prove`` (docs/prove.md): the records of a fit in
the order they happen with the documented fields; nothing at all without ``LIGHTNING_RESUME_TRACE``; the
same losses, weights and RNG streams with and without it; a resumed launch's ``start`` at the restored step."""

from __future__ import annotations

import json
import os
import struct
import time

import lightning.pytorch as lightning
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_resume import ExactResume, ScheduleOptions
from lightning_resume.errors import ConfigurationError, ExactResumeWarning
from lightning_resume.exact.state import fingerprint, rng
from lightning_resume.prove import trace
from tests.helpers.filesystem import listing
from tests.helpers.models import TinyData, TinyModel, tiny_trainer

pytestmark = pytest.mark.timeout(120)

BATCH_FIELDS = {"kind", "step", "micro", "epoch", "batch", "rng", "sched", "user", "loss", "lr", "logged"}
WEIGHT_FIELDS = {"kind", "step", "params", "optim"}


def _bits(loss: torch.Tensor) -> str:
    """As the test jobs write a loss (tests/helpers/jobs/trainee.py): an oracle independent of ``float_bits``."""
    return f"{struct.unpack('<I', struct.pack('<f', loss.detach().float().item()))[0]:08x}"


class Witness(Callback):
    """Sees each batch as ExactResume's recorder does (it runs after it, drawing nothing): the batch and RNG
    digests at the batch start, the loss the step returned, the state after each optimizer step."""

    def __init__(self) -> None:
        self.batches: list[str] = []
        self.rngs: list[str] = []
        self.losses: list[str] = []
        self.params: dict[int, str] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(fingerprint.digest(batch))
        self.rngs.append(fingerprint.digest(rng.capture_rng()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(_bits(outputs["loss"]))
        self.params[trainer.global_step] = fingerprint.digest(pl_module.state_dict())


class NoisyModel(TinyModel):
    """Draws from torch's stream at every step: a draw made by the recorder would change every later loss."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return super().training_step([x + 0.1 * torch.randn_like(x), y], batch_idx)


def _records(directory) -> list[dict]:
    with open(os.path.join(directory, "trace-rank0.jsonl")) as f:
        return [json.loads(line) for line in f]


def _trace_to(monkeypatch, directory, every: int | None = None) -> None:
    monkeypatch.setenv(trace.TRACE_ENV, str(directory))
    if every is None:
        monkeypatch.delenv(trace.DIGEST_EVERY_ENV, raising=False)
    else:
        monkeypatch.setenv(trace.DIGEST_EVERY_ENV, str(every))


def _fit(callbacks, model=TinyModel, ckpt_path=None, **kwargs):
    lightning.seed_everything(0, verbose=False)
    trainer = tiny_trainer([ExactResume(mtbf=None), *callbacks], **{"limit_train_batches": 4, **kwargs})
    trainer.fit(model(), TinyData(), ckpt_path=ckpt_path)
    return trainer


def test_a_fit_writes_every_record_in_the_order_it_happens(tmp_path, monkeypatch):
    _trace_to(monkeypatch, tmp_path / "trace", every=4)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".in-flight.tmp").write_bytes(b"")  # a hidden temporary: no checkpoint
    witness = Witness()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)
    before = time.time()
    trainer = _fit([ckpt, witness], model=NoisyModel, max_epochs=2, num_sanity_val_steps=1)

    records = _records(tmp_path / "trace")
    kinds = [(r["kind"], r["step"]) for r in records]
    epoch = [("batch", 0), ("batch", 1), ("batch", 2), ("batch", 3), ("state", 4), ("val_start", 4), ("val", 4)]
    later = [("batch", 4), ("batch", 5), ("batch", 6), ("batch", 7), ("state", 8), ("val_start", 8), ("val", 8)]
    epoch, later = [*epoch, ("saved", 4)], [*later, ("saved", 8)]
    assert kinds == [("start", 0), *epoch, *later, ("end", 8)]  # no val record of the sanity check

    start, end = records[0], records[-1]
    assert start == {
        "kind": "start", "pid": os.getpid(), "rank": 0, "world_size": 1, "step": 0, "resumed_from": None,
        "exact": None, "problems": [], "findings": [], "schedulers": [], "time": start["time"],
        "loaders": {"mode": None, "each": [{"type": "ResumableDataLoader", "dataset": "TensorDataset", "iterable": False}]},
    }  # fmt: skip
    assert before <= start["time"] <= time.time()

    batches = [r for r in records if r["kind"] == "batch"]
    assert all(set(r) == BATCH_FIELDS for r in batches)
    assert [(r["micro"], r["epoch"]) for r in batches] == [(i, e) for e in (0, 1) for i in range(4)]
    assert [r["batch"] for r in batches] == witness.batches  # the batch as the step got it
    assert [r["rng"] for r in batches] == witness.rngs  # the streams at the batch start
    assert [r["loss"] for r in batches] == witness.losses == [_bits(x) for x in trainer.lightning_module.step_losses]
    assert all(r["lr"] == [0.05] and r["sched"] == [] for r in batches)
    assert len(set(witness.batches)) == 4  # TinyData in order: the same 4 batches each epoch
    assert len(set(witness.rngs)) == 8  # every step draws its noise after the digest

    weights = [r for r in records if r["kind"] in ("state", "saved", "end")]
    assert all(
        set(r) - {"sched", "metrics", "files", "timed_files", "retention_files"} == WEIGHT_FIELDS for r in weights
    )
    assert all(r["params"] == witness.params[r["step"]] for r in weights)
    assert {r["optim"] for r in weights} == {fingerprint.digest([opt.state_dict() for opt in trainer.optimizers])}

    vals = [r for r in records if r["kind"] == "val"]
    assert set(vals[-1]["metrics"]) == {"train_loss", "val/loss"}
    assert vals[-1]["metrics"]["val/loss"] == _bits(trainer.callback_metrics["val/loss"])
    assert vals[0]["metrics"]["val/loss"] != vals[-1]["metrics"]["val/loss"]

    assert end["sched"] == fingerprint.digest([])  # no LR scheduler
    assert end["metrics"] == {name: _bits(value) for name, value in trainer.callback_metrics.items()}
    assert end["files"] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
    assert end["timed_files"] == end["retention_files"] == []  # no snapshot was taken


class Unsaveable:
    """State a checkpoint cannot hold pickle-free: its ``state_dict()`` holds a function."""

    def state_dict(self):
        return {"transform": print}

    def load_state_dict(self, state):
        pass


class OwnStateModel(TinyModel):
    """Keeps state ExactResume cannot save: a fresh run is warned that resumes will not be exact."""

    def __init__(self) -> None:
        super().__init__()
        self.holder = Unsaveable()


def test_the_start_record_lists_what_exact_resume_warned_about(tmp_path, monkeypatch):
    _trace_to(monkeypatch, tmp_path)
    with pytest.warns(ExactResumeWarning) as caught:
        _fit([], model=OwnStateModel, max_steps=1, enable_checkpointing=False)
    warned = [str(w.message).removeprefix("ExactResume: ") for w in caught if w.category is ExactResumeWarning]
    start = _records(tmp_path)[0]
    assert start["problems"] == warned and any("holder" in line for line in start["problems"])
    unsaved = [f for f in start["findings"] if f["kind"] == "user_state"]  # the kind, as it was found
    assert [(f["subject"], f["line"] in warned) for f in unsaved] == [("model.holder", True)]


class PlateauModel(TinyModel):
    """Returns a ReduceLROnPlateau from configure_optimizers: Lightning saves it, and the trace digests it per step."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "train_loss"}}


def test_schedulers_and_captured_state_are_digested_as_each_step_starts(tmp_path, monkeypatch):
    _trace_to(monkeypatch, tmp_path)
    trainer = _fit([], model=PlateauModel, max_epochs=3, enable_checkpointing=False)
    records = _records(tmp_path)
    assert records[0]["schedulers"] == [{"type": "ReduceLROnPlateau", "plateau": True, "interval": "epoch"}]
    digests = [r["sched"][0] for r in records if r["kind"] == "batch"]
    assert len(set(digests[:4])) == 1 and digests[4] != digests[3]  # stepped at the end of the first epoch
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert digests[-1] != fingerprint.digest(scheduler.state_dict())  # the last epoch's step came after it

    recorder = trace.from_environment(0, fingerprint.digest, rng.capture_rng, {trace.TRACE_ENV: str(tmp_path / "u")},
                                      components=lambda: {"model.lr_scheduler": "d1"})  # fmt: skip
    assert recorder is not None
    recorder.start(trainer, None, [])
    recorder.batch_start(trainer, torch.zeros(1))
    recorder.batch_end(trainer, {"loss": torch.tensor(1.0)}, 0)
    recorder.close()
    assert _records(tmp_path / "u")[1]["user"] == {"model.lr_scheduler": "d1"}


def test_a_save_the_clock_chose_is_marked_timed(tmp_path, monkeypatch):
    _trace_to(monkeypatch, tmp_path / "trace")
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4)
    lightning.seed_everything(0, verbose=False)
    exact = ExactResume(mtbf=None, schedule=ScheduleOptions(every_n_train_steps_max=3))
    trainer = tiny_trainer([exact, ckpt], limit_train_batches=4, max_steps=7)  # ModelCheckpoint's newest: step 4
    trainer.fit(TinyModel(), TinyData())
    records = _records(tmp_path / "trace")
    saves = [(r["step"], r.get("timed", False)) for r in records if r["kind"] == "saved"]
    assert saves == [(3, True), (4, False), (6, True)]
    end = records[-1]
    assert end["timed_files"] == ["last-snapshot-step=000000006.ckpt"] and end["retention_files"] == []
    assert "last-snapshot-step=000000006.ckpt" in end["files"]


def test_state_records_come_every_k_optimizer_steps_not_every_k_micro_batches(tmp_path, monkeypatch):
    _trace_to(monkeypatch, tmp_path, every=2)
    _fit([], max_steps=4, limit_train_batches=8, accumulate_grad_batches=2, enable_checkpointing=False)
    kinds = [(r["kind"], r["step"]) for r in _records(tmp_path) if r["kind"] in ("batch", "state")]
    pair = lambda step: [("batch", step), ("batch", step)]
    assert kinds == [*pair(0), *pair(1), ("state", 2), *pair(2), *pair(3), ("state", 4)]


def test_state_records_default_to_every_ten_steps(tmp_path, monkeypatch):
    _trace_to(monkeypatch, tmp_path)
    _fit([], max_steps=20, limit_train_batches=8, enable_checkpointing=False)
    assert [r["step"] for r in _records(tmp_path) if r["kind"] == "state"] == [10, 20]


def test_without_the_variable_nothing_is_written_and_nothing_hashed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(trace.TRACE_ENV, raising=False)

    def hashed(*args):
        raise AssertionError("the recorder hashed or captured")

    monkeypatch.setattr(fingerprint, "digest", hashed)
    monkeypatch.setattr(rng, "capture_rng", hashed)
    _fit([], max_epochs=1, enable_checkpointing=False)
    assert listing(tmp_path) == []

    _trace_to(monkeypatch, tmp_path / "trace")  # the same fit with the variable reaches the patched hash
    with pytest.raises(AssertionError, match="the recorder hashed"):
        _fit([], max_epochs=1, enable_checkpointing=False)


def test_recording_leaves_losses_weights_and_rng_streams_bit_for_bit_alone(tmp_path, monkeypatch):
    def run(name: str):
        witness = Witness()
        ckpt = ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=3, save_top_k=-1)
        trainer = _fit([ckpt, witness], model=NoisyModel, max_epochs=2, limit_train_batches=5)
        weights = [p.detach().clone() for p in trainer.lightning_module.parameters()]
        return witness.losses, weights, fingerprint.digest(rng.capture_rng())

    monkeypatch.delenv(trace.TRACE_ENV, raising=False)
    plain = run("plain")
    _trace_to(monkeypatch, tmp_path / "trace", every=2)
    traced = run("traced")

    assert len(plain[0]) == 10 and len(set(plain[0])) == 10
    assert traced[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(traced[1], plain[1]))
    assert traced[2] == plain[2]  # no stream advanced: Python, NumPy, torch
    records = _records(tmp_path / "trace")
    assert [r["loss"] for r in records if r["kind"] == "batch"] == plain[0]
    assert sum(r["kind"] == "saved" for r in records) == 3  # steps 3, 6, 9


def test_a_resumed_launch_starts_at_the_restored_step_and_goes_on_as_the_uninterrupted_run(tmp_path, monkeypatch):
    _trace_to(monkeypatch, tmp_path / "a")
    _fit([ModelCheckpoint(dirpath=tmp_path / "a-ckpt")], model=NoisyModel, max_steps=6)
    uninterrupted = [r for r in _records(tmp_path / "a") if r["kind"] == "batch"]

    _trace_to(monkeypatch, tmp_path / "b")
    saves = ModelCheckpoint(dirpath=tmp_path / "b-ckpt", every_n_train_steps=3, save_top_k=-1)
    _fit([saves], model=NoisyModel, max_steps=3)
    path = str(tmp_path / "b-ckpt" / "epoch=0-step=3.ckpt")
    resumed = ModelCheckpoint(dirpath=tmp_path / "b-ckpt", every_n_train_steps=3, save_top_k=-1)
    _fit([resumed], model=NoisyModel, max_steps=6, ckpt_path=path)

    records = _records(tmp_path / "b")
    starts = [i for i, r in enumerate(records) if r["kind"] == "start"]
    assert len(starts) == 2  # both launches append to the rank's one file
    second = records[starts[1]]
    assert (second["step"], second["resumed_from"], second["exact"], second["problems"]) == (3, path, True, [])
    after = [r for r in records[starts[1] :] if r["kind"] == "batch"]
    assert [(r["step"], r["micro"]) for r in after] == [(3, 3), (4, 0), (5, 1)]
    assert after == uninterrupted[3:]  # same batch, RNG streams, loss and learning rate as run A


def test_a_torn_last_line_stays_a_line_of_its_own(tmp_path):
    (tmp_path / "trace-rank1.jsonl").write_bytes(b'{"kind":"start"}\n{"kind":"ba')  # a launch killed mid-write
    recorder = trace.from_environment(1, fingerprint.digest, rng.capture_rng, {trace.TRACE_ENV: str(tmp_path)})
    assert recorder is not None
    recorder.out.write({"kind": "start", "step": 3})
    recorder.close()
    lines = (tmp_path / "trace-rank1.jsonl").read_text().splitlines()
    assert lines == ['{"kind":"start"}', '{"kind":"ba', '{"kind":"start","step":3}']


def test_the_variables_are_read_as_documented(tmp_path):
    assert trace.from_environment(0, fingerprint.digest, rng.capture_rng, {}) is None
    assert trace.from_environment(0, fingerprint.digest, rng.capture_rng, {trace.TRACE_ENV: ""}) is None
    env = {trace.TRACE_ENV: str(tmp_path / "new"), trace.DIGEST_EVERY_ENV: "5"}
    recorder = trace.from_environment(2, fingerprint.digest, rng.capture_rng, env)
    assert recorder is not None and recorder.digest_every == 5 and recorder.rank == 2
    recorder.close()
    assert listing(tmp_path) == ["new/trace-rank2.jsonl"]
    assert trace.digest_every_from(None) == trace.digest_every_from(" ") == 10
    for bad in ("0", "-3", "ten", "2.5"):
        with pytest.raises(ConfigurationError, match=f"{trace.DIGEST_EVERY_ENV}='{bad}'"):
            trace.from_environment(0, fingerprint.digest, rng.capture_rng, {**env, trace.DIGEST_EVERY_ENV: bad})


def test_float_bits_and_the_loss_a_step_returned():
    assert trace.float_bits(torch.tensor(1.0)) == "3f800000"
    assert trace.float_bits(torch.tensor([[-2.0]], dtype=torch.float64)) == trace.float_bits(-2) == "c0000000"
    assert trace.float_bits(0.72) == _bits(torch.tensor(0.72))
    assert [trace.float_bits(v) for v in (torch.ones(2), "1.0", None, True)] == [None] * 4
    loss = torch.tensor(0.5)
    assert trace.loss_of({"loss": loss, "other": 1}) is trace.loss_of(loss) is loss
    assert trace.loss_of(None) is trace.loss_of({"x": loss}) is trace.loss_of(0.5) is None
