"""``SafetensorsCheckpointIO(dedupe=True)``: what a save writes, every read path resolving the refs, and a
missing or damaged block refused naming the checkpoint, the tensor, the pack and the key."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import threading

import pytest
import torch

from lightning_resume.cas import layout, live
from lightning_resume.cas.refs import read_pack_header, read_refs
from lightning_resume.cas.save import Lineage, commit_deduped
from lightning_resume.errors import (
    CheckpointCorruptError,
    ConfigurationError,
    RemoteLoadMemoryError,
    SkippedCheckpointWarning,
)
from lightning_resume.format import atomic, referenced, write
from lightning_resume.format.read import load_file
from lightning_resume.io.plugin import SafetensorsCheckpointIO
from lightning_resume.storage import files as storage
from tests.helpers.compare import assert_bitwise

FROZEN = "state_dict.frozen"


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(0)
    frozen = torch.randn(256, 128, generator=g)  # 128 KiB: referenced
    head = torch.randn(128, 64, generator=g) + step  # 32 KiB... made 128 KiB below
    return {
        "state_dict": {"frozen": frozen, "head": head.repeat(1, 4), "bias": torch.full((8,), float(step))},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.full((128, 256), float(step))}}}],
        "global_step": step,
    }


def _saved(tmp_path, steps=(1, 2), **io_args) -> tuple[SafetensorsCheckpointIO, list[str]]:
    io = SafetensorsCheckpointIO(dedupe=True, **io_args)
    paths = []
    for step in steps:
        paths.append(str(tmp_path / f"step={step}.ckpt"))
        io.save_checkpoint(_state(step), paths[-1])
    io.teardown()
    return io, paths


@pytest.mark.parametrize(
    "args, says",
    [
        ({"checksum": "crc32"}, "dedupe=True needs a 128-bit or stronger checksum; use checksum='xxh3-128'"),
        ({"writer": "process"}, "use writer='thread' (the default; save='async' or 'overlapped' still writes off"),
    ],
)
def test_dedupe_refuses_what_it_cannot_support_naming_the_option_and_the_fix(args, says):
    with pytest.raises(ConfigurationError, match=re.escape(says)):
        SafetensorsCheckpointIO(dedupe=True, **args)
    SafetensorsCheckpointIO(dedupe=False, **args)  # each alone is a valid option


def test_dedupe_must_be_a_bool():
    with pytest.raises(ConfigurationError, match="dedupe='yes' must be True or False"):
        SafetensorsCheckpointIO(dedupe="yes")  # type: ignore[arg-type]


def test_the_second_save_references_the_unchanged_tensor_and_writes_the_rest_into_a_smaller_pack(tmp_path):
    _, (first, second) = _saved(tmp_path)
    one, two = read_refs(first), read_refs(second)
    assert one.lineage == two.lineage and set(one.tensors) == {
        FROZEN,
        "state_dict.head",
        "optimizer_states.0.state.0.exp_avg",
    }
    assert one.tensors[FROZEN].pack == one.wrote  # written once, by the first save
    assert two.tensors[FROZEN] == one.tensors[FROZEN] and two.wrote != one.wrote  # referenced by the second
    pack = read_pack_header(layout.pack_path(second, two.wrote))
    assert FROZEN not in pack.keys and one.tensors[FROZEN].key not in pack.keys
    state = sum(r.nbytes for r in two.tensors.values())
    assert sum(pack.keys.values()) == state - two.tensors[FROZEN].nbytes
    assert os.path.getsize(second) < 4096  # the checkpoint file: the tree, the small tensors, the records


@pytest.mark.parametrize("how", ["copy", "mmap", "unverified", "unverified mmap"])
def test_every_local_read_path_loads_the_saved_state_bitwise(tmp_path, how):
    _, paths = _saved(tmp_path)
    for step, path in zip((1, 2), paths):
        loaded = load_file(path, mmap="mmap" in how, verify="unverified" not in how).checkpoint
        assert_bitwise(_state(step), loaded, f"{how} step {step}")


def test_a_load_in_place_reads_referenced_weights_into_the_given_tensors(tmp_path):
    _, (_, second) = _saved(tmp_path)
    into = {("state_dict", "frozen"): torch.zeros(256, 128), ("state_dict", "head"): torch.zeros(128, 256)}
    loaded = load_file(second, into=into)
    assert loaded.checkpoint["state_dict"]["frozen"] is into[("state_dict", "frozen")]
    assert_bitwise(_state(2), loaded.checkpoint, "in place")
    assert set(loaded.in_place) == set(into)


def test_a_remote_save_and_load_resolve_the_refs(tmp_path):
    url = "memory://cas-remote/run"
    io = SafetensorsCheckpointIO(dedupe=True)
    for step in (1, 2):
        io.save_checkpoint(_state(step), f"{url}/step={step}.ckpt")
    refs = read_refs(f"{url}/step=2.ckpt")
    assert refs.tensors[FROZEN].pack != refs.wrote
    for step in (1, 2):
        assert_bitwise(_state(step), SafetensorsCheckpointIO().load_checkpoint(f"{url}/step={step}.ckpt"), "remote")


def _damage(path: str, how: str) -> tuple[str, str]:
    """Damage the pack holding the frozen weight of ``path``: its pack path and key."""
    ref = read_refs(path).tensors[FROZEN]
    pack = layout.pack_path(path, ref.pack)
    if how == "missing pack":
        os.remove(pack)
    elif how == "flipped byte":
        data = bytearray(open(pack, "rb").read())
        at = data.index(bytes(torch.randn(256, 128, generator=torch.Generator().manual_seed(0)).numpy().tobytes()[:64]))
        data[at + 100] ^= 0x01
        open(pack, "wb").write(bytes(data))
    return pack, ref.key


@pytest.mark.parametrize("mmap", [False, True])
@pytest.mark.parametrize("how, says", [("missing pack", "the pack is missing"), ("flipped byte", "checksum mismatch")])
def test_a_missing_or_damaged_block_is_refused_naming_checkpoint_tensor_pack_and_key(tmp_path, how, says, mmap):
    _, (_, second) = _saved(tmp_path)
    pack, key = _damage(second, how)
    with pytest.raises(CheckpointCorruptError) as info:
        load_file(second, mmap=mmap)
    message = str(info.value)
    assert info.value.path == second and says in message
    assert f"tensor '{FROZEN}'" in message and pack in message and key in message


def test_a_pack_without_the_block_is_refused_naming_it(tmp_path):
    _, (first, second) = _saved(tmp_path)
    ref = read_refs(second).tensors[FROZEN]
    other = read_refs(second).wrote  # a pack of the lineage that lacks the frozen block, under the frozen one's name
    shutil.copyfile(layout.pack_path(second, other), layout.pack_path(second, ref.pack))
    with pytest.raises(CheckpointCorruptError, match=re.escape(f"key {ref.key}): the pack has no such block")):
        load_file(second)


def test_a_failed_checkpoint_write_leaves_the_committed_pack_and_the_previous_checkpoint_loadable(
    tmp_path, monkeypatch
):
    io, (first,) = _saved(tmp_path, steps=(1,))
    packs_before = set(os.listdir(tmp_path / "blocks"))

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed between the pack and the checkpoint file")

    monkeypatch.setattr(write, "commit", killed)
    io = SafetensorsCheckpointIO(dedupe=True)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint(_state(2), str(tmp_path / "step=2.ckpt"))
    assert not (tmp_path / "step=2.ckpt").exists() and set(os.listdir(tmp_path / "blocks")) > packs_before
    assert live.pending() == set()  # the holds end with the save, failed or not
    assert_bitwise(_state(1), load_file(first).checkpoint, "previous")


def test_a_save_redone_writes_the_same_pack_name(tmp_path):
    state = Lineage()
    tree, tensors = write.encode_tree(_state(1))
    one = commit_deduped(
        str(tmp_path / "a.ckpt"), tree, tensors, "xxh3-128", Lineage(lineage=state.lineage or "ab" * 16)
    )
    two = commit_deduped(str(tmp_path / "b.ckpt"), tree, tensors, "xxh3-128", Lineage(lineage="ab" * 16))
    assert one.wrote == two.wrote and len(os.listdir(tmp_path / "blocks")) == 1


def test_equal_tensors_are_one_block(tmp_path):
    same = torch.ones(64, 1024)
    tree, tensors = write.encode_tree({"a": same, "b": same.clone(), "c": torch.zeros(64, 1024)})
    refs = commit_deduped(str(tmp_path / "e.ckpt"), tree, tensors, "xxh3-128", Lineage())
    assert refs.tensors["a"].key == refs.tensors["b"].key
    assert len(read_pack_header(layout.pack_path(str(tmp_path / "e.ckpt"), refs.wrote)).keys) == 2
    loaded = load_file(str(tmp_path / "e.ckpt")).checkpoint
    assert torch.equal(loaded["a"], same) and torch.equal(loaded["b"], same)


def test_a_held_pack_removed_since_is_not_referenced_the_tensor_is_written_again(tmp_path):
    io, (first,) = _saved(tmp_path, steps=(1,))
    os.remove(layout.pack_path(first, read_refs(first).wrote))
    second = str(tmp_path / "step=2.ckpt")
    io.save_checkpoint(_state(2), second)
    assert read_refs(second).tensors[FROZEN].pack == read_refs(second).wrote
    assert_bitwise(_state(2), load_file(second).checkpoint, "rewritten")


def test_a_resumed_run_continues_the_lineage_and_references_the_frozen_weight(tmp_path):
    _, (first,) = _saved(tmp_path, steps=(1,))
    io = SafetensorsCheckpointIO(dedupe=True)
    io.load_checkpoint(first)
    second = str(tmp_path / "step=2.ckpt")
    io.save_checkpoint(_state(2), second)
    one, two = read_refs(first), read_refs(second)
    assert two.lineage == one.lineage and two.tensors[FROZEN].pack == one.wrote != two.wrote


@pytest.mark.parametrize("save", ["async", "overlapped"])
def test_async_saves_write_packs_and_load_bitwise(tmp_path, save):
    io, paths = _saved(tmp_path, steps=(1, 2, 3), save=save)
    refs = [read_refs(p) for p in paths]
    assert refs[2].tensors[FROZEN].pack == refs[0].wrote != refs[2].wrote
    for step, path in zip((1, 2, 3), paths):
        assert_bitwise(_state(step), SafetensorsCheckpointIO().load_checkpoint(path), f"{save} step {step}")


def test_without_dedupe_nothing_is_referenced(tmp_path):
    path = str(tmp_path / "plain.ckpt")
    SafetensorsCheckpointIO().save_checkpoint(_state(1), path)
    assert read_refs(path).tensors == {} and not (tmp_path / "blocks").exists()


def test_an_s3_save_writes_packs_there_and_loads_bitwise(s3_bucket):
    url = f"{s3_bucket}/cas"
    io = SafetensorsCheckpointIO(dedupe=True)
    for step in (1, 2):
        io.save_checkpoint(_state(step), f"{url}/step={step}.ckpt")
    one, two = read_refs(f"{url}/step=1.ckpt"), read_refs(f"{url}/step=2.ckpt")
    assert two.tensors[FROZEN].pack == one.wrote != two.wrote
    for step in (1, 2):
        assert_bitwise(_state(step), SafetensorsCheckpointIO().load_checkpoint(f"{url}/step={step}.ckpt"), "s3")


def test_a_pack_temporary_of_a_killed_save_is_removed_by_the_next_save(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "blocks").mkdir()
    stale = tmp_path / "blocks" / f".pack.tmp-{atomic.owner_token()}-{dead.pid}-deadbeef"
    stale.write_bytes(b"half a pack")
    _saved(tmp_path, steps=(1,))
    assert not stale.exists()


def test_dedupe_under_a_strategy_that_saves_directories_is_refused_at_fit_start_naming_it():
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_resume.io.plugin import refuse_dedupe_with_directory_saves

    sharded = pl.Trainer(strategy=ModelParallelStrategy(), plugins=[SafetensorsCheckpointIO(dedupe=True)],
                         accelerator="cpu", devices=1, logger=False)  # fmt: skip
    with pytest.raises(
        ConfigurationError, match="dedupe=True is not supported under ModelParallelStrategy.*dedupe=False"
    ):
        refuse_dedupe_with_directory_saves(sharded)
    plain = pl.Trainer(plugins=[SafetensorsCheckpointIO(dedupe=True)], accelerator="cpu", devices=1, logger=False)
    refuse_dedupe_with_directory_saves(plain)  # one file per save: supported
    full = pl.Trainer(strategy=ModelParallelStrategy(save_distributed_checkpoint=False),
                      plugins=[SafetensorsCheckpointIO(dedupe=True)], accelerator="cpu", devices=1, logger=False)  # fmt: skip
    refuse_dedupe_with_directory_saves(full)


@pytest.mark.parametrize("save", ["sync", "async", "overlapped"])
def test_a_second_save_at_the_same_step_writes_no_pack(tmp_path, save):
    io = SafetensorsCheckpointIO(dedupe=True, save=save)
    for name in (
        "step=1.ckpt",
        "step=2.ckpt",
        "epoch=0-step=2.ckpt",
        "last.ckpt",
    ):  # as ModelCheckpoint(save_last=True)
        io.save_checkpoint(_state(int(name[-6])) if name != "last.ckpt" else _state(2), str(tmp_path / name))
    io.teardown()
    assert read_refs(str(tmp_path / "epoch=0-step=2.ckpt")).wrote is None
    assert read_refs(str(tmp_path / "last.ckpt")).wrote is None
    assert len(os.listdir(tmp_path / "blocks")) == 2
    assert_bitwise(_state(2), load_file(str(tmp_path / "last.ckpt")).checkpoint, "last")


def test_a_remote_load_counts_the_referenced_blocks_against_its_memory_cap():
    url = "memory://cas-budget/run/step=1.ckpt"
    SafetensorsCheckpointIO(dedupe=True).save_checkpoint(_state(1), url)
    small = storage.size(url)
    cap = small + storage.reader_overhead(small) + (64 << 10)  # the file fits; with its 384 KiB of blocks it does not
    with pytest.raises(RemoteLoadMemoryError, match="remote.max_load_bytes"):
        load_file(url, max_remote_load_bytes=cap)
    assert_bitwise(_state(1), load_file(url, max_remote_load_bytes=64 << 20).checkpoint, "within the cap")


def test_a_last_checkpoint_whose_block_is_missing_falls_back_to_the_newest_that_loads(tmp_path):
    io = SafetensorsCheckpointIO(dedupe=True)
    io.save_checkpoint(_state(1), str(tmp_path / "step=1.ckpt"))
    last = str(tmp_path / "last.ckpt")
    io.save_checkpoint(_state(2), last)
    os.remove(layout.pack_path(last, read_refs(last).wrote))  # the head and moments of step 2 are gone
    with pytest.warns(SkippedCheckpointWarning, match=r"tensor '.*' \(pack .*, key [0-9a-f]+\): the pack is missing"):
        loaded = SafetensorsCheckpointIO(dedupe=True).load_checkpoint(last)
    assert_bitwise(_state(1), loaded, "fallback")


def test_equal_tensors_hashed_first_are_written_once_in_one_pass(tmp_path, monkeypatch):
    from lightning_resume.cas import write_pack

    same, head = torch.ones(64, 1024), torch.zeros(64, 1024)
    state = Lineage()
    for step in (1, 2):  # head changes at save 2: written while hashed at save 3
        tree, tensors = write.encode_tree({"a": same, "b": same.clone(), "head": head + step})
        commit_deduped(str(tmp_path / f"{step}.ckpt"), tree, tensors, "xxh3-128", state, step=step)
    tree, tensors = write.encode_tree({"a": same, "b": same.clone(), "head": head + 3})
    state.held = {}  # nothing to reference: a and b (hashed first, equal) and head (unknown key) go into one pack
    rewrites = []
    monkeypatch.setattr(
        write_pack, "_EqualBlocks", type("Counted", (Exception,), {"__init__": lambda e: rewrites.append(1)})
    )
    refs = commit_deduped(str(tmp_path / "3.ckpt"), tree, tensors, "xxh3-128", state, step=3)
    assert rewrites == [] and refs.tensors["a"].key == refs.tensors["b"].key
    assert len(read_pack_header(layout.pack_path(str(tmp_path / "3.ckpt"), refs.wrote)).keys) == 2
    assert_bitwise({"a": same, "b": same, "head": head + 3}, load_file(str(tmp_path / "3.ckpt")).checkpoint, "once")


def test_io_verify_reads_every_referenced_block(tmp_path):
    from lightning_resume.io.verify import verify

    _, (_, second) = _saved(tmp_path)
    verify(second)
    pack, key = _damage(second, "flipped byte")
    with pytest.raises(CheckpointCorruptError, match=re.escape(f"(pack {pack}, key {key}): checksum mismatch")):
        verify(second)


def test_a_pack_that_is_not_a_regular_file_is_refused_without_opening_it(tmp_path):
    _, (_, second) = _saved(tmp_path)
    pack, _ = _damage(second, "missing pack")
    os.mkfifo(pack)  # opening it for reading would wait for a writer forever
    with pytest.raises(CheckpointCorruptError, match="the pack is not a regular file"):
        load_file(second)


def _commit(path: str, step: int, state: Lineage, frozen: torch.Tensor) -> None:
    tree, tensors = write.encode_tree(
        {"global_step": step, "state_dict": {"frozen": frozen, "head": torch.randn(65536)}}
    )
    commit_deduped(path, tree, tensors, "xxh3-128", state, step=step)


def test_a_collection_beside_a_save_in_flight_never_removes_a_pack_that_save_commits_to(tmp_path, monkeypatch):
    """Lightning's ``AsyncCheckpointIO`` saves on its own thread while the training thread removes an older checkpoint
    and collects: a collection while the save's new pack is renamed in but not yet referenced removes nothing of it."""
    from lightning_resume.cas import gc
    from lightning_resume.cas import save as cas_save

    state, frozen = Lineage(), torch.randn(65536)
    _commit(str(tmp_path / "a.ckpt"), 1, state, frozen)
    _commit(str(tmp_path / "b.ckpt"), 2, state, frozen)
    renamed, collected = threading.Event(), threading.Event()
    commit_pack = cas_save.commit_pack

    def paused(*args, **kwargs):
        out = commit_pack(*args, **kwargs)
        renamed.set()  # the pack is in blocks/ under its name; no checkpoint names it yet
        assert collected.wait(60), "the collection never ran"
        return out

    monkeypatch.setattr(cas_save, "commit_pack", paused)
    saving = threading.Thread(target=_commit, args=(str(tmp_path / "c.ckpt"), 3, state, frozen))
    saving.start()
    assert renamed.wait(60), "the save never wrote its pack"
    removed = gc.remove_and_collect(str(tmp_path / "a.ckpt"))
    collected.set()
    saving.join(60)
    assert removed == [], removed  # a save in flight in that directory: nothing is collected now
    load_file(str(tmp_path / "c.ckpt"))  # every block it references is there, and verifies
    assert gc.remove_and_collect(str(tmp_path / "b.ckpt")) != []  # once no save is in flight, the orphans go
    load_file(str(tmp_path / "c.ckpt"))


def test_a_refs_record_claiming_a_huge_tensor_is_refused_before_any_allocation(tmp_path):
    """A crafted shape in the refs record is checked against the block's size in its pack before memory is taken."""
    path = str(tmp_path / "a.ckpt")
    _commit(path, 1, Lineage(), torch.randn(65536))
    refs = read_refs(path)
    ref = refs.tensors[FROZEN]
    huge = dataclasses.replace(ref, shape=(1 << 38,))
    forged = dataclasses.replace(refs, tensors={**refs.tensors, FROZEN: huge})
    with pytest.raises(CheckpointCorruptError, match="block size differs"):
        referenced.read_referenced(path, forged, [FROZEN], check=None)
