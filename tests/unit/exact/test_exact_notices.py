"""``ExactResume(preemption=PreemptionOptions(notices=...))`` in one process, against a metadata server on 127.0.0.1: the
options are checked at construction; ``on_notice="snapshot"`` saves once and trains on; a hanging or
malformed endpoint never interrupts training; ``"auto"`` on a machine without cloud DMI evidence starts no
thread and opens no socket. (The kill-and-resume runs are in tests/integration/test_cloud_notices.py.)"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import lightning
import pytest
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_resume import ConfigurationError, ExactResume, PreemptionOptions
from lightning_resume.cloud.poller import THREAD_NAME
from tests.helpers.metadata import FakeMetadata, fake_dmi, serving
from tests.helpers.models import TinyData, TinyModel, tiny_trainer


class _Slow(Callback):
    """Each step takes a little wall time, so the poller (every 50 ms) sees a change within a few steps."""

    def __init__(self, state: FakeMetadata, announce_at: int) -> None:
        self.state, self.announce_at = state, announce_at

    def on_train_batch_end(self, trainer, *args) -> None:
        time.sleep(0.03)
        if trainer.global_step == self.announce_at:
            self.state.gce_preempted = b"TRUE"


def _fit(tmp_path: Path, exact: ExactResume, *extra: Callback, max_steps: int = 30) -> lightning.Trainer:
    lightning.seed_everything(0, verbose=False)
    callbacks = [exact, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=0), *extra]
    trainer = tiny_trainer(callbacks, max_steps=max_steps, limit_train_batches=10)
    trainer.fit(TinyModel(), datamodule=TinyData())
    return trainer


def _exact(tmp_path: Path, url: str, **preemption) -> ExactResume:
    dmi = fake_dmi(tmp_path / "dmi", "gcp")
    notices = PreemptionOptions(notices="auto", endpoint=url, poll_interval=0.05, dmi_dir=dmi, **preemption)
    return ExactResume(mtbf=None, preemption=notices)


def test_options_are_checked_at_construction() -> None:
    with pytest.raises(ConfigurationError) as err:
        ExactResume(
            preemption=PreemptionOptions(notices=["aws", "ibm"], on_notice="pause", endpoint="ftp://x", poll_interval=0)
        )
    text = str(err.value)
    assert "preemption.notices=('aws', 'ibm')" in text and "'ibm'" in text and "preemption.on_notice='pause'" in text
    assert "preemption.endpoint='ftp://x'" in text and "preemption.poll_interval=0.0s" in text


def test_on_notice_snapshot_saves_once_and_trains_to_the_end(tmp_path: Path) -> None:
    with serving() as gce:
        trainer = _fit(tmp_path, _exact(tmp_path, gce.url, on_notice="snapshot"), _Slow(gce, announce_at=5))
    assert trainer.global_step == 30, "training went on after the notice"
    snapshots = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert len(snapshots) == 1 and 5 < int(snapshots[0].split("=")[-1].split(".")[0]) < 30, snapshots


def test_on_notice_stop_stops_after_a_durable_snapshot(tmp_path: Path) -> None:
    with serving() as gce:
        trainer = _fit(tmp_path, _exact(tmp_path, gce.url), _Slow(gce, announce_at=5))
    assert 5 < trainer.global_step < 30
    (snapshot,) = (tmp_path / "ckpt").iterdir()
    assert f"{trainer.global_step:09d}" in snapshot.name


def test_a_hanging_endpoint_never_interrupts_training(tmp_path: Path) -> None:
    with serving() as gce:
        gce.hang_s = 30.0  # every answer waits longer than the poller's timeout
        with pytest.warns(Warning, match="timed out|timeout"):
            trainer = _fit(tmp_path, _exact(tmp_path, gce.url), _Slow(gce, announce_at=-1), max_steps=12)
    assert trainer.global_step == 12
    assert not [t for t in threading.enumerate() if t.name == THREAD_NAME], "the poller was stopped"


def test_auto_without_cloud_evidence_starts_nothing_and_opens_no_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    connects: list = []
    real = socket.socket.connect
    monkeypatch.setattr(socket.socket, "connect", lambda self, address: connects.append(address) or real(self, address))
    empty = tmp_path / "no-dmi"
    empty.mkdir()
    exact = ExactResume(
        mtbf=None, preemption=PreemptionOptions(notices="auto", dmi_dir=str(empty))
    )  # the clouds' own endpoints
    _fit(tmp_path, exact, max_steps=4)
    assert connects == [] and exact.notices is not None and exact.notices.clouds == ()
    assert not [t for t in threading.enumerate() if t.name == THREAD_NAME]
