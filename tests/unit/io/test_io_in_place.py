"""Loads that read a checkpoint's weights straight into the module (``load_in_place``): which tensors qualify
(``format.in_place.plan``), that they are the module's own memory afterwards with the file's bytes, that a
corrupt file says what it overwrote and the "last" fallback overwrites it again, and that a Lightning resume
through ``ExactResume`` reads in place and checks the module against the file's digests."""

from __future__ import annotations

import collections
import enum
import sys
import types
import uuid
import warnings
from pathlib import Path

import fsspec
import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_resume import ExactResume, RetentionCheckpoint, SafetensorsCheckpointIO
from lightning_resume.errors import CheckpointCorruptError, PartialLoadError, ResumeMismatchError, UnknownTypeError
from lightning_resume.format import framing, in_place, partial, read, write
from lightning_resume.format.codec import encode
from lightning_resume.format.framing import Entry
from lightning_resume.storage import files as storage


def flip_byte_of_tensor(path: str, name: str) -> None:
    """Flip one bit in the middle of tensor ``name``'s bytes in the file."""
    data = open(path, "rb").read()
    header = framing.parse_header(path, data[: 8 + framing.header_length(path, data[:8], len(data))], len(data))
    e = header.entries[name]
    offset = header.data_start + (e.begin + e.end) // 2
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes([data[offset] ^ 0x10]))


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    weights = collections.OrderedDict(w=torch.randn(64, 32, generator=g), b=torch.randn(32, generator=g))
    return {"state_dict": weights, "optimizer_states": [{"m": torch.randn(8, generator=g)}], "global_step": 3}


def _module_like(state: dict) -> dict:
    return {("state_dict", k): torch.zeros_like(v) for k, v in state["state_dict"].items()}


# ---------------------------------------------------------------------------------------------- plan


def _entry(name: str, dtype: str = "F32", shape: tuple = (4,)) -> Entry:
    return Entry(name, dtype, shape, 0, 4 * int(torch.Size(shape).numel()))


def test_the_plan_takes_matching_dense_cpu_tensors_by_their_place_in_the_tree():
    tree = encode({"state_dict": collections.OrderedDict(a=torch.zeros(4), b=torch.zeros(4), c=torch.zeros(4))}).tree
    entries = {k: _entry(k) for k in ("state_dict.a", "state_dict.b", "state_dict.c")}
    a, wrong_dtype, strided = torch.empty(4), torch.empty(4, dtype=torch.float64), torch.empty(8)[::2]
    offered = {("state_dict", "a"): a, ("state_dict", "b"): wrong_dtype, ("state_dict", "c"): strided}
    offered[("state_dict", "absent")] = torch.empty(4)
    offered[("elsewhere", "a")] = torch.empty(4)
    assert in_place.plan(tree, entries, offered) == {"state_dict.a": a}
    assert in_place.plan(tree, {"state_dict.a": _entry("state_dict.a", shape=(2, 2))}, offered) == {}


def test_destinations_that_share_memory_for_two_tensors_of_the_file_are_left_out():
    tree = encode({"state_dict": {"a": torch.zeros(4), "b": torch.zeros(4), "c": torch.zeros(4)}}).tree
    entries = {k: _entry(k) for k in ("state_dict.a", "state_dict.b", "state_dict.c")}
    tied, c = torch.empty(4), torch.empty(4)
    offered = {("state_dict", "a"): tied, ("state_dict", "b"): tied, ("state_dict", "c"): c}
    assert in_place.plan(tree, entries, offered) == {"state_dict.c": c}
    big = torch.empty(12)
    overlapping = {("state_dict", "a"): big, ("state_dict", "b"): big[4:8], ("state_dict", "c"): c}
    entries["state_dict.a"] = _entry("state_dict.a", shape=(12,))
    assert in_place.plan(tree, entries, overlapping) == {"state_dict.c": c}


# ---------------------------------------------------------------------------------------------- read


@pytest.mark.parametrize("verify", [True, False])
def test_a_load_into_destinations_fills_them_and_hands_them_back(tmp_path: Path, verify: bool):
    state, path = _state(), str(tmp_path / "x.ckpt")
    write.save_file(state, path)
    into = _module_like(state)
    loaded = read.load_file(path, verify=verify, into=into)
    for (_, name), t in into.items():
        assert loaded.checkpoint["state_dict"][name] is t and torch.equal(t, state["state_dict"][name])
    assert torch.equal(loaded.checkpoint["optimizer_states"][0]["m"], state["optimizer_states"][0]["m"])
    assert set(loaded.in_place) == set(into)
    algorithm, _ = loaded.in_place[("state_dict", "w")]
    assert algorithm == "xxh3-128"


def test_no_destination_is_used_with_mmap_or_for_another_device(tmp_path: Path):
    state, path = _state(), str(tmp_path / "x.ckpt")
    write.save_file(state, path)
    for options in ({"mmap": True}, {"map_location": "meta"}):
        into = _module_like(state)
        loaded = read.load_file(path, into=into, **options)
        assert loaded.in_place == {} and not torch.any(into[("state_dict", "w")])


def test_a_checksum_failure_names_the_tensors_overwritten(tmp_path: Path):
    """(That one was said before issue 41; it now carries the count, which marks the module: below.)"""
    state, path = _state(), str(tmp_path / "x.ckpt")
    write.save_file(state, path)
    flip_byte_of_tensor(path, "state_dict.b")
    into = _module_like(state)
    with pytest.raises(CheckpointCorruptError, match=r"state_dict\.b.*read in place before the failure") as caught:
        read.load_file(path, into=into)
    assert "build the model again" in str(caught.value)
    assert caught.value.overwritten_in_place == 1  # b, the first in the file, failed: w was never touched
    clean = _module_like(state)
    with pytest.raises(CheckpointCorruptError) as plain:
        read.load_file(path)  # nothing offered: the error as before
    assert "in place" not in str(plain.value)
    assert not torch.any(clean[("state_dict", "w")])


def _with_enum_of_a_module_not_imported(state: dict) -> tuple:
    """``state`` plus an enum member whose module is imported only while the file is written (issue 41, 7); and
    that module's name."""
    name = f"lr_colors_{uuid.uuid4().hex[:8]}"
    module = types.ModuleType(name)
    color = enum.Enum("Color", "RED GREEN", module=name)  # type: ignore[misc]
    module.Color = color  # type: ignore[attr-defined]
    sys.modules[name] = module
    return {**state, "hyper": {"color": color.GREEN}}, name


def test_a_tree_that_fails_to_decode_after_in_place_writes_says_how_many(tmp_path: Path):
    (state, name), path = _with_enum_of_a_module_not_imported(_state()), str(tmp_path / "x.ckpt")
    write.save_file(state, path)
    del sys.modules[name]  # the load runs where the enum's module was never imported
    into = _module_like(state)
    with pytest.raises(PartialLoadError, match=r"2 tensor\(s\) of the module Net were read in place") as caught:
        read.load_file(path, into=into, into_owner="the module Net")
    assert isinstance(caught.value.__cause__, UnknownTypeError) and caught.value.overwritten_in_place == 2
    assert "accept_partial" in str(caught.value)
    assert torch.equal(into[("state_dict", "w")], state["state_dict"]["w"])  # it did overwrite: and said so


def test_a_remote_in_place_load_cut_mid_body_says_it_overwrote(tmp_path: Path, monkeypatch):
    state, path = _state(), str(tmp_path / "x.ckpt")
    write.save_file(state, path)
    data = open(path, "rb").read()
    url = f"memory://cut-{uuid.uuid4().hex[:8]}/x.ckpt"
    fsspec.filesystem("memory").pipe_file(url, data)
    header = framing.parse_header(path, data[: 8 + framing.header_length(path, data[:8], len(data))], len(data))
    e = header.entries["state_dict.w"]
    cut_at = header.data_start + (e.begin + e.end) // 2  # the connection drops in the middle of a weight

    class Cut(storage.RangedReader):
        def readinto(self, b):
            if self._pos + len(memoryview(b)) > cut_at:
                raise ConnectionResetError(104, "Connection reset by peer")
            return super().readinto(b)

    monkeypatch.setattr(storage, "RangedReader", Cut)
    into = _module_like(state)
    begun = sum(1 for name, x in header.entries.items() if name.startswith("state_dict.") and x.begin <= e.begin)
    with pytest.raises(PartialLoadError, match=rf"ConnectionResetError.*{begun} tensor\(s\) of its caller") as caught:
        read.load_file(url, into=into)
    assert isinstance(caught.value.__cause__, OSError) and caught.value.overwritten_in_place == begun


# ------------------------------------------------------------------------------------------ Lightning


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 16)
        self.head = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.head(self.layer(x)) - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class _Hooked(_Net):
    def on_load_checkpoint(self, checkpoint):
        checkpoint["state_dict"]["head.bias"] = checkpoint["state_dict"]["head.bias"] * 0


class _WritesIntoTheDict(pl.Callback):
    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        checkpoint["state_dict"]["layer.bias"].add_(1.0)  # in place: into the module, when it was read in place


def _fit(dirpath: Path, steps: int, model: pl.LightningModule, resume: bool, extra=(), **io) -> pl.Trainer:
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)), batch_size=4)
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ExactResume(), RetentionCheckpoint(dirpath=dirpath, every_n_train_steps=3), *extra],
        plugins=[SafetensorsCheckpointIO(**io)],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data, ckpt_path="last" if resume else None)
    return trainer


def test_a_resume_reads_the_weights_into_the_module_and_checks_them_against_the_file(tmp_path: Path):
    _fit(tmp_path, 6, _Net(), resume=False)
    reference = _fit(tmp_path / "other", 8, _Net(), resume=False).lightning_module.state_dict()
    model = _Net()
    trainer = _fit(tmp_path, 8, model, resume=True)
    assert set(trainer.strategy.checkpoint_io.loaded_in_place()) == set(model.state_dict())
    report = trainer.callbacks[0].resume_report
    assert report["exact"] and report["fingerprint_ok"]
    for name, value in model.state_dict().items():
        assert torch.equal(value, reference[name]), name
    off = _fit(tmp_path, 8, _Net(), resume=True, load_in_place=False)
    assert off.strategy.checkpoint_io.loaded_in_place() == {}


def test_a_module_that_overrides_on_load_checkpoint_loads_as_before(tmp_path: Path):
    _fit(tmp_path, 6, _Hooked(), resume=False)
    model = _Hooked()
    trainer = _fit(tmp_path, 6, model, resume=True)
    assert trainer.strategy.checkpoint_io.loaded_in_place() == {}


def test_a_callback_writing_into_the_loaded_weights_is_caught_by_the_check_after_restore(tmp_path: Path):
    _fit(tmp_path, 6, _Net(), resume=False)
    with pytest.raises(ResumeMismatchError, match="fingerprint after restore"):
        _fit(tmp_path, 8, _Net(), resume=True, extra=[_WritesIntoTheDict()])


def test_after_the_restore_no_load_reads_into_the_live_module(tmp_path: Path):
    """The module is offered for the restore of a fit only: a fit that loaded nothing, then a load of some
    checkpoint by hand (an inspection, during or after training), leaves the module's weights alone."""
    _fit(tmp_path / "other", 6, _Net(), resume=False)
    model = _Net()
    trainer = _fit(tmp_path, 3, model, resume=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    io = trainer.strategy.checkpoint_io
    io.load_checkpoint(str(next((tmp_path / "other").glob("*.ckpt"))))
    assert io.loaded_in_place() == {}
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def _fit_from(dirpath: Path, steps: int, model: pl.LightningModule, ckpt_path) -> pl.Trainer:
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)), batch_size=4)
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ExactResume(), RetentionCheckpoint(dirpath=dirpath, every_n_train_steps=3)],
        plugins=[SafetensorsCheckpointIO()],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer


def test_a_fit_on_a_module_a_failed_load_half_overwrote_is_refused_until_told(tmp_path: Path):
    """Issue 41, 7: a checksum failure in the file's second weight, then ``fit(model)`` in the same process."""
    _fit(tmp_path, 6, _Net(), resume=False)
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_bytes(next(p for p in tmp_path.glob("*.ckpt") if not p.name.startswith("last")).read_bytes())
    flip_byte_of_tensor(str(damaged), "state_dict.layer.bias")  # layer.weight before it is already the file's
    model = _Net()
    with pytest.raises(CheckpointCorruptError, match=r"[0-9]+ tensor\(s\) of the module _Net were read in place"):
        _fit_from(tmp_path / "a", 8, model, str(damaged))
    with pytest.raises(PartialLoadError, match=r"refusing to train _Net.*overwritten [0-9]+ of its tensors"):
        _fit_from(tmp_path / "b", 8, model, None)
    partial.accept_partial(model)  # the user says: train on it as it is
    assert _fit_from(tmp_path / "c", 4, model, None).global_step == 4


def test_a_load_that_succeeds_into_the_module_lifts_the_refusal(tmp_path: Path):
    _fit(tmp_path, 6, _Net(), resume=False)
    good = next(p for p in tmp_path.glob("*.ckpt") if not p.name.startswith("last"))
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_bytes(good.read_bytes())
    flip_byte_of_tensor(str(damaged), "state_dict.layer.bias")
    model = _Net()
    with pytest.raises(CheckpointCorruptError):
        _fit_from(tmp_path / "a", 8, model, str(damaged))
    assert _fit_from(tmp_path / "b", 8, model, str(good)).global_step == 8  # resumed: the module is the file's
    assert _fit_from(tmp_path / "c", 10, model, None).global_step == 10
