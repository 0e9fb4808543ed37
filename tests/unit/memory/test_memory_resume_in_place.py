"""A memory-tier resume checks each byte once and reads the state once: a file received from a peer is checked as
it arrives (a damaged one refused before the rename), this rank's own snapshot by the offer, and the load that
follows reads the very descriptor that was checked, with no second digest pass, its weights straight into the
module the durable IO is offered (``protocols.in_place_target``), as a durable resume reads them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import lightning
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_resume import ExactResume, MemoryTierOptions, SafetensorsCheckpointIO, ScheduleOptions, collective
from lightning_resume.errors import CheckpointCorruptError
from lightning_resume.format import framing, integrity, partial, read
from lightning_resume.io.plugin import destinations
from lightning_resume.memory import peers
from lightning_resume.memory.recover import plan_recovery
from lightning_resume.memory.store import MemoryStore, memory_root, replica_name
from lightning_resume.memory.tier import MemoryTier
from tests.helpers.callbacks import CrashAt
from tests.helpers.models import TinyData, TinyModel, tiny_trainer

K = "0123456789abcdef"


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"global_step": step, "state_dict": {"w": torch.randn(3000, generator=g), "b": torch.zeros(0)}}


def _chunks(data: bytes, size: int) -> Iterator[memoryview]:
    view = memoryview(data)
    return (view[i : i + size] for i in range(0, len(data), size))


def _store(tmp_path: Path, name: str, rank: int = 0) -> MemoryStore:
    return MemoryStore(memory_root(str(tmp_path / name)), K, rank=rank, world_size=2, asynchronous=False)


def _snapshot_bytes(tmp_path: Path, step: int = 5, rank: int = 0) -> bytes:
    owner = _store(tmp_path, f"owner{step}-{rank}", rank)
    owner.save(_state(step), step=step, seq=step, run="r")
    data = Path(owner.path).read_bytes()
    owner.free()
    return data


def _tensor_offset(data: bytes, name: str) -> int:
    header = framing.parse_header("x", data[: 8 + framing.header_length("x", data[:8], len(data))], len(data))
    e = header.entries[name]
    return header.data_start + (e.begin + e.end) // 2


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes fed to any digest check (``integrity.DataCheck.update``), in order."""
    fed: list[int] = []
    update = integrity.DataCheck.update

    def counting(self: integrity.DataCheck, data: Any) -> None:
        fed.append(len(memoryview(data).cast("B")))
        update(self, data)

    monkeypatch.setattr(integrity.DataCheck, "update", counting)
    return fed


def _data_bytes(data: bytes) -> int:
    return len(data) - 8 - framing.header_length("x", data[:8], len(data))


# ------------------------------------------------------------------------------------------- checked as it arrives


@pytest.mark.parametrize("size", [1, 7, 4096, 1 << 20])
def test_a_received_file_is_checked_as_it_arrives_in_chunks_of_any_size(tmp_path: Path, size: int) -> None:
    data = _snapshot_bytes(tmp_path)
    store = _store(tmp_path, "node")
    path = store.write_received(store.name, len(data), _chunks(data, size), verify=True)
    assert Path(path).read_bytes() == data


@pytest.mark.parametrize("where", ["tensor", "header"])
def test_a_byte_damaged_in_the_stream_is_refused_before_the_rename(tmp_path: Path, where: str) -> None:
    """The file of that name stays the one before (here: an older snapshot), and no temporary is left."""
    data, old = _snapshot_bytes(tmp_path, step=5), _snapshot_bytes(tmp_path, step=3)
    store = _store(tmp_path, "node")
    store.write_received(store.name, len(old), [memoryview(old)])
    damaged = bytearray(data)
    damaged[_tensor_offset(data, "state_dict.w") if where == "tensor" else 60] ^= 0x10
    match = "state_dict.w.*checksum mismatch" if where == "tensor" else "."
    with pytest.raises(CheckpointCorruptError, match=match):
        store.write_received(store.name, len(data), _chunks(bytes(damaged), 999), verify=True)
    assert Path(store.path).read_bytes() == old
    assert sorted(os.listdir(store.directory)) == sorted([store.name, store.owner_name])


def test_unchecked_receipt_stays_as_it_was_for_replication(tmp_path: Path) -> None:
    """Replication during training writes what arrives and leaves the check to the holder's offer."""
    data = bytearray(_snapshot_bytes(tmp_path))
    data[_tensor_offset(bytes(data), "state_dict.w")] ^= 0x10
    store = _store(tmp_path, "node", rank=1)
    store.write_received(replica_name(0, 2), len(data), [memoryview(bytes(data))])
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        store.check_replica(0, "r")


# ------------------------------------------------------------------------------------------------ checked once


def test_a_file_checked_on_arrival_is_loaded_without_a_second_digest_pass(tmp_path: Path, hashed: list) -> None:
    data = _snapshot_bytes(tmp_path)
    store = _store(tmp_path, "node")
    store.write_received(store.name, len(data), _chunks(data, 4096), verify=True)
    assert sum(hashed) == _data_bytes(data)  # every data byte once, as it arrived
    checked = store.check("r")
    assert checked is not None and (checked.step, checked.seq) == (5, 5)
    assert sum(hashed) == _data_bytes(data)  # the record was at hand: nothing read again
    loaded = store.load("r")
    assert sum(hashed) == _data_bytes(data)  # and the tensors are read unhashed
    assert loaded is not None and torch.equal(loaded.checkpoint["state_dict"]["w"], _state(5)["state_dict"]["w"])


def test_the_unchecked_load_reads_the_descriptor_that_was_checked_not_the_name(tmp_path: Path) -> None:
    """A file renamed over the name after the check (here a damaged one) is not what the unchecked load reads; the
    next load, with nothing checked, reads the name and verifies it."""
    data = _snapshot_bytes(tmp_path)
    store = _store(tmp_path, "node")
    store.write_received(store.name, len(data), [memoryview(data)], verify=True)
    damaged = bytearray(data)
    damaged[_tensor_offset(data, "state_dict.w")] ^= 0x10
    Path(store.path + ".new").write_bytes(bytes(damaged))
    os.replace(store.path + ".new", store.path)
    loaded = store.load("r")
    assert loaded is not None and torch.equal(loaded.checkpoint["state_dict"]["w"], _state(5)["state_dict"]["w"])
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        store.load("r")


def test_the_own_snapshot_is_checked_by_the_offer_and_read_once_unhashed(tmp_path: Path, hashed: list) -> None:
    """The offer checks it a chunk at a time without building its tensors; the load that follows the plan reads
    it from the same descriptor without hashing; a save in between drops that descriptor (the new file is
    verified as it is read)."""
    store = _store(tmp_path, "node")
    store.save(_state(5), step=5, seq=5, run="r")
    data = Path(store.path).read_bytes()
    own, offered = peers.offer(store, "r", [], durable_step=1)
    assert own is not None and offered.own is not None and offered.own.save == (5, 5)
    assert own.checkpoint["state_dict"]["w"].stride() == (0,)  # a stand-in: no tensor held to offer it
    assert sum(hashed) == _data_bytes(data)
    loaded = store.load("r")
    assert sum(hashed) == _data_bytes(data)  # not checked a second time
    assert loaded is not None and torch.equal(loaded.checkpoint["state_dict"]["w"], _state(5)["state_dict"]["w"])
    peers.offer(store, "r", [], durable_step=1)
    store.save(_state(6), step=6, seq=6, run="r")
    hashed.clear()
    again = store.load("r")
    assert again is not None and again.step == 6 and sum(hashed) == _data_bytes(Path(store.path).read_bytes())


def test_a_load_reads_the_weights_into_the_tensors_offered(tmp_path: Path) -> None:
    store = _store(tmp_path, "node")
    store.save(_state(5), step=5, seq=5, run="r")
    assert store.check("r") is not None
    w = torch.zeros(3000)
    pointer = w.data_ptr()
    loaded = store.load("r", into={("state_dict", "w"): w})
    assert loaded is not None and loaded.checkpoint["state_dict"]["w"] is w and w.data_ptr() == pointer
    assert torch.equal(w, _state(5)["state_dict"]["w"])
    recorded = read.read_summary(store.path).record["tensors"]["state_dict.w"][2]
    assert loaded.in_place == {("state_dict", "w"): ("xxh3-128", recorded)}


# -------------------------------------------------------------------------------------------- in a Lightning fit


class _Aliases(Callback):
    """At the restore: whether each weight Lightning was handed is the module's own memory, the storages of the
    module's parameters before the restore and after it, and the weights then."""

    def __init__(self) -> None:
        self.before: dict[str, int] = {}
        self.after: dict[str, int] = {}
        self.aliased: dict[str, bool] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.trainer: Any = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.before = {n: p.data_ptr() for n, p in pl_module.named_parameters()}

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        own = dict(pl_module.named_parameters())
        self.aliased = {n: t.data_ptr() == own[n].data_ptr() for n, t in checkpoint["state_dict"].items()}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.after = {n: p.data_ptr() for n, p in pl_module.named_parameters()}
        self.weights = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        self.trainer = trainer


def _fit(tmp_path: Path, shm: Path, crash_at: int, extra: tuple = ()) -> None:
    lightning.seed_everything(0, verbose=False)
    exact = ExactResume(
        mtbf=None,
        schedule=ScheduleOptions(every_n_train_steps_max=6),
        memory_tier=MemoryTierOptions(dir=str(shm), every_n_train_steps_max=2),
    )
    callbacks = [exact, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=0), *extra, CrashAt(crash_at)]
    trainer = tiny_trainer(callbacks, max_steps=12, limit_train_batches=4, plugins=[SafetensorsCheckpointIO()])
    with pytest.raises(RuntimeError, match="crash"):
        trainer.fit(TinyModel(), datamodule=TinyData(), ckpt_path="last")


def test_a_memory_resume_reads_the_weights_into_the_modules_own_storage(tmp_path: Path, shm: Path) -> None:
    _fit(tmp_path, shm, crash_at=9)
    (snapshot,) = shm.glob("*/*/rank-0-of-1.safetensors")
    saved = read.load_file(str(snapshot)).checkpoint["state_dict"]
    aliases = _Aliases()
    _fit(tmp_path, shm, crash_at=8, extra=(aliases,))  # stops as soon as it resumed
    resumed = next(c for c in aliases.trainer.callbacks if isinstance(c, ExactResume))
    assert resumed.resume_report.tier == "memory" and resumed.resume_report.step == 8
    assert resumed.resume_report.exact and resumed.resume_report.fingerprint_ok
    assert aliases.aliased and all(aliases.aliased.values()), aliases.aliased  # read in place: nothing to copy
    assert aliases.after == aliases.before  # the module's own storages, not new ones
    assert resumed.memory is not None
    assert set(resumed.memory.loaded_in_place(aliases.trainer)) == set(saved)  # checked against the file's digests
    for name, value in saved.items():
        assert torch.equal(aliases.weights[name], value), name  # bitwise the snapshot's


# ------------------------------------------------------------------------------------- the tier's part, one process


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)


def _tier_with_snapshot(tmp_path: Path) -> tuple[MemoryTier, _Net, dict]:
    """A one-rank tier whose slot holds a snapshot of run "r" at step 5, and a module offered as a durable IO
    would offer it (``protocols.in_place_target``)."""
    tier = MemoryTier(str(tmp_path / "m"))
    tier.store = MemoryStore(tier.root, K, rank=0, world_size=1, asynchronous=False)
    saved = {name: t.clone() for name, t in _Net().state_dict().items()}
    tier.store.save({"global_step": 5, "state_dict": saved}, step=5, seq=5, run="r")
    module = _Net()
    tier._target = lambda: (module, destinations(module))
    return tier, module, saved


def _plan(tier: MemoryTier) -> tuple[Any, Any]:
    assert tier.store is not None
    mine, offered = peers.offer(tier.store, "r", [], durable_step=1)
    return plan_recovery([offered], 1, 1), mine


def test_the_tier_reads_the_agreed_state_into_the_offered_module(tmp_path: Path) -> None:
    tier, module, saved = _tier_with_snapshot(tmp_path)
    pointers = {n: p.data_ptr() for n, p in module.named_parameters()}
    outcome, mine = _plan(tier)
    snapshot, reason = tier._recover(outcome, mine, "r")
    assert snapshot is not None and reason == "" and snapshot.step == 5
    assert {n: p.data_ptr() for n, p in module.named_parameters()} == pointers
    for name, value in module.state_dict().items():
        assert torch.equal(value, saved[name]) and snapshot.checkpoint["state_dict"][name] is not None
    assert set(tier._in_place) == {"net.weight", "net.bias"}
    assert partial.refusal(module, resumed=False) is None


def test_weights_read_in_place_for_a_resume_another_rank_abandoned_are_marked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another rank's problem sends every rank to disk after this one read its state into the module: the module
    is marked as after a failed in-place load (the durable load replaces it; a fit restoring nothing refuses)."""
    tier, module, _ = _tier_with_snapshot(tmp_path)
    outcome, mine = _plan(tier)
    monkeypatch.setattr(collective, "gather", lambda problems: [problems, ["rank 1: its state is gone"]])
    snapshot, reason = tier._recover(outcome, mine, "r")
    assert snapshot is None and "rank 1: its state is gone" in reason
    refused = partial.refusal(module, resumed=False)
    assert refused is not None and "memory-tier resume was abandoned" in str(refused)
    assert partial.refusal(module, resumed=True) is None  # a durable restore into it lifts it
