"""The memory tier on a machine shared with other users (issue 24): ``/dev/shm`` is world-writable, so another
user may create our root first, plant files or links, or read what we write. Each test acts as that user for
real: a second local account (made here when the tests run as root, skipped otherwise), its commands run with
``setpriv``. Nothing touches the real ``/dev/shm/lightning-resume*``: every test uses a fresh sticky,
world-writable directory on a tmpfs, as ``/dev/shm`` itself is."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

import lightning
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_resume import (
    ExactResume,
    ExactResumeWarning,
    MemoryTierOptions,
    SafetensorsCheckpointIO,
    ScheduleOptions,
)
from lightning_resume.format import write
from lightning_resume.format.atomic import STALE_AFTER_S
from lightning_resume.memory import peers
from lightning_resume.memory import store as memory_tier
from lightning_resume.memory.store import MemoryStore, memory_root
from lightning_resume.storage.private import UntrustedDirectory
from tests.helpers.accounts import other_user
from tests.helpers.models import TinyData, TinyModel, tiny_trainer

"""The second local user the tests act as."""

SLOT = "0123456789abcdef"


@pytest.fixture
def other() -> Callable[[str], subprocess.CompletedProcess]:
    """Run a shell command as the second user."""
    uid, gid = other_user()

    def run(command: str) -> subprocess.CompletedProcess:
        argv = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "sh", "-c", command]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)

    return run


@pytest.fixture
def shm() -> Iterator[Path]:
    """A fresh directory like /dev/shm: on tmpfs, world-writable, sticky."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    root = base / f"lr-shared-test-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    os.chmod(root, 0o1777)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _state(step: int) -> dict:
    return {"global_step": step, "w": torch.arange(4096, dtype=torch.float32) + step}


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_root_another_user_made_first_is_refused_for_saves_and_loads(shm: Path, other) -> None:
    """Item 1: the other user creates our root before us and plants a snapshot in it; we neither save into it
    nor load from it (before: a fixed name, never checked, and their weights loaded as ours)."""
    root = Path(memory_root(str(shm)))
    made = other(f"mkdir -m 0777 {root} && mkdir -m 0777 {root}/{SLOT}")
    assert made.returncode == 0, made.stderr
    ours = MemoryStore(str(root), SLOT, rank=0, world_size=1, asynchronous=False)
    with pytest.raises(UntrustedDirectory, match=f"{root} belongs to uid"):
        ours.save(_state(3), step=3, seq=1, run="r")
    assert os.listdir(root / SLOT) == []  # nothing of ours written into their directory
    os.chown(root / SLOT, os.geteuid(), os.getegid())  # even a slot of ours inside their root is not trusted
    with pytest.raises(UntrustedDirectory, match="belongs to uid"):
        ours.load("r")
    with pytest.warns(ExactResumeWarning, match="skipping the memory-tier snapshot"):
        assert peers.offer(ours, "r", [], durable_step=-1)[0] is None


def test_a_link_or_an_open_mode_in_place_of_our_root_is_refused(shm: Path) -> None:
    root = Path(memory_root(str(shm)))
    target = shm / "elsewhere"
    target.mkdir(mode=0o700)
    root.symlink_to(target)
    with pytest.raises(UntrustedDirectory, match="symbolic link"):
        MemoryStore(str(root), SLOT, 0, 1, asynchronous=False).save(_state(1), step=1, seq=1, run="r")
    root.unlink()
    root.mkdir(mode=0o700)
    os.chmod(root, 0o755)
    with pytest.raises(UntrustedDirectory, match="mode 0755"):
        MemoryStore(str(root), SLOT, 0, 1, asynchronous=False).save(_state(1), step=1, seq=1, run="r")
    assert os.listdir(target) == []


def test_the_async_write_never_reopens_its_temporary_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 2: whoever controls the directory swaps a link to a victim file in for the temporary between its
    creation and the direct write; the bytes must not reach the victim (before: ``~/.bashrc`` overwritten)."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    directory = tmp_path / "ckpt"
    directory.mkdir()
    real = write.integrity.make_record
    swapped: list[str] = []

    def swap_then_record(*args, **kwargs):
        if not swapped:  # the first header is built after the temporary exists, before its data is written
            (tmp,) = [p for p in directory.iterdir() if ".tmp-" in p.name]
            tmp.unlink()
            tmp.symlink_to(victim)
            swapped.append(tmp.name)
        return real(*args, **kwargs)

    monkeypatch.setattr(write.integrity, "make_record", swap_then_record)
    io = SafetensorsCheckpointIO(save="async")  # its snapshot image is written with direct I/O where allowed
    io.save_checkpoint(_state(5), directory / "a.ckpt")
    io.teardown()
    assert swapped and victim.read_bytes() == b"precious"


def test_cleanup_touches_only_this_users_slots_holding_only_our_files(shm: Path, other) -> None:
    """Item 3: an old data set preloaded on the tmpfs, another user's root, and directories of ours that are not
    slots or hold a file we did not write all stay (before: any old subdirectory without a live owner went)."""
    root = Path(memory_root(str(shm)))
    root.mkdir(mode=0o700)
    old = time.time() - 2 * STALE_AFTER_S

    def aged(directory: Path, files: dict[str, bytes]) -> Path:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        for name, data in files.items():
            (directory / name).write_bytes(data)
        for p in [*directory.iterdir(), directory]:
            os.utime(p, (old, old))
        return directory

    dataset = aged(shm / "imagenet-shard-0", {"part-0.bin": b"data"})
    not_a_slot = aged(root / "my-notes", {"rank-0-of-1.safetensors": b"x"})
    foreign_file = aged(root / ("e" * 16), {"rank-0-of-1.safetensors": b"x", "README": b"mine"})
    stale = aged(root / ("f" * 16), {"rank-0-of-1.safetensors": b"x", "rank-0-of-1.owner": b"0 1"})
    theirs = Path(memory_root(str(shm))).with_name("lightning-resume-99999")
    assert other(f"mkdir -m 0777 -p {theirs}/{'a' * 16} && touch -d '2 days ago' {theirs}/{'a' * 16}").returncode == 0
    removed = MemoryStore(str(root), SLOT, 0, 1).clean_stale()
    assert removed == [str(stale)]
    assert dataset.exists() and not_a_slot.exists() and foreign_file.exists() and (theirs / ("a" * 16)).exists()


def _fifo_owner(path: Path) -> None:
    os.mkfifo(path)


def _sparse_owner(path: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(64 << 30)


def _binary_owner(path: Path) -> None:
    path.write_bytes(b"\xff\xfe\x00 invalid utf-8")


@pytest.mark.parametrize("plant", [_fifo_owner, _sparse_owner, _binary_owner], ids=["fifo", "sparse-64GiB", "binary"])
def test_a_planted_owner_file_neither_crashes_nor_hangs_a_snapshot(tmp_path: Path, plant) -> None:
    """Item 4: a FIFO, a 64 GiB sparse file or invalid UTF-8 under an owner file's name (before: a hang,
    ``MemoryError``, ``UnicodeDecodeError``, outside any ``try``)."""
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    old_slot = root / ("a" * 16)
    old_slot.mkdir(mode=0o700)
    (old_slot / "rank-0-of-1.safetensors").write_bytes(b"x")
    plant(old_slot / "rank-0-of-1.owner")
    for p in [*old_slot.iterdir(), old_slot]:
        os.utime(p, (time.time() - 2 * STALE_AFTER_S,) * 2)
    own = root / SLOT
    own.mkdir(mode=0o700)
    plant(own / "rank-0-of-1.owner")
    store = MemoryStore(str(root), SLOT, 0, 1, asynchronous=False)
    outcome: list[object] = []

    def snapshot() -> None:
        outcome.append(store.clean_stale())
        outcome.append(store.save(_state(2), step=2, seq=1, run="r"))

    worker = threading.Thread(target=snapshot, daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "the snapshot hung on a planted owner file"
    assert outcome[0] == [str(old_slot)] and isinstance(outcome[1], int)
    assert store.load("r") is not None


def test_every_directory_and_file_is_private(shm: Path, other) -> None:
    """Item 5: root and slot 0700, snapshot and owner 0600, whatever the umask; the other user reads nothing
    (before: 0755 and 0644, so anyone on the node could read the whole checkpoint)."""
    old_umask = os.umask(0o022)
    try:
        store = MemoryStore(memory_root(str(shm)), SLOT, 0, 1)
        store.save(_state(7), step=7, seq=1, run="r")
        store.wait()
    finally:
        os.umask(old_umask)
    root = Path(store.root)
    assert (_mode(root), _mode(root / SLOT)) == (0o700, 0o700)
    assert (_mode(Path(store.path)), _mode(Path(store.owner_path))) == (0o600, 0o600)
    denied = other(f"cat {store.path} > /dev/null")
    assert denied.returncode != 0 and "Permission denied" in denied.stderr


def test_each_user_has_a_root_of_their_own(shm: Path, other) -> None:
    """Item 6: another user who snapshots first does not lock us out (before: one root per node, owned by the
    first user; every other user's saves failed with PermissionError and the tier was silently off)."""
    theirs = Path(str(shm)) / "lightning-resume-other"
    assert other(f"mkdir -m 0700 {theirs} && echo x > {theirs}/state").returncode == 0  # their tier, in use
    store = MemoryStore(memory_root(str(shm)), SLOT, 0, 1, asynchronous=False)
    assert store.save(_state(1), step=1, seq=1, run="r") > 0
    assert store.load("r") is not None
    assert Path(store.root).name == f"lightning-resume-{os.geteuid()}"


class _Crash(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("crash")


def _fit(
    ckpt: Path, shm: Path, ckpt_path, crash_at=None, plugins=None, durable_every: int = 6, **ckpt_args
) -> ExactResume:
    lightning.seed_everything(0, verbose=False)
    exact = ExactResume(
        mtbf=None,
        schedule=ScheduleOptions(every_n_train_steps_max=durable_every),
        memory_tier=MemoryTierOptions(dir=str(shm), every_n_train_steps_max=2),
    )
    callbacks = [exact, ModelCheckpoint(dirpath=ckpt, **{"save_top_k": 0, **ckpt_args})] + (
        [_Crash(crash_at)] if crash_at else []
    )
    trainer = tiny_trainer(callbacks, max_steps=16, limit_train_batches=4, plugins=plugins or [])
    trainer.fit(TinyModel(), datamodule=TinyData(), ckpt_path=ckpt_path)
    return exact


def _snapshot_steps(shm: Path) -> list[int]:
    return [
        int(memory_tier.read.load_file(str(p)).checkpoint[memory_tier.MEMORY_KEY]["step"])
        for p in shm.rglob("rank-*.safetensors")
    ]


def test_clearing_the_checkpoint_directory_starts_a_new_run(tmp_path: Path, shm: Path) -> None:
    """Item 7: ``rm -rf ckpt/*`` then ``fit(ckpt_path="last")`` trains from step 0 (before: a hidden run-id file
    survived and the old run's memory snapshot was resumed, contrary to the README)."""
    ckpt = tmp_path / "ckpt"
    with pytest.raises(RuntimeError, match="crash"):
        _fit(ckpt, shm, "last", crash_at=9)
    assert _snapshot_steps(shm) == [8]
    for p in ckpt.glob("*"):  # what `rm -rf ckpt/*` removes: every name without a leading dot
        p.unlink()
    fresh = _fit(ckpt, shm, "last")
    assert fresh.resume_report.tier is None and fresh.resume_report.source is None
    assert not _snapshot_steps(shm), "the old run's snapshot is dropped, and this run's freed at its end"


def test_a_newer_torch_save_checkpoint_beats_an_older_memory_snapshot(tmp_path: Path, shm: Path) -> None:
    """Item 8: with Lightning's default checkpoint format, the durable step is read too (before: -1, so the
    memory snapshot of step 4 beat the durable checkpoint ``ModelCheckpoint`` wrote at step 5)."""
    ckpt, own_schedule = tmp_path / "ckpt", {"every_n_train_steps": 5, "save_top_k": -1}
    with pytest.raises(RuntimeError, match="crash"):
        _fit(ckpt, shm, "last", crash_at=5, durable_every=100, **own_schedule)
    assert _snapshot_steps(shm) == [4] and (ckpt / "epoch=1-step=5.ckpt").exists()
    resumed = _fit(ckpt, shm, "last", durable_every=100, **own_schedule)
    assert resumed.resume_report.tier == "durable" and resumed.resume_report.step == 5


def _their_directory(root: Path, other) -> None:
    assert other(f"mkdir -m 0777 {root}").returncode == 0


def _a_file(root: Path, other) -> None:
    root.write_bytes(b"not a directory")


def _a_dangling_link(root: Path, other) -> None:
    root.symlink_to(root.with_name("nowhere"))


@pytest.mark.parametrize(
    "squat", [_their_directory, _a_file, _a_dangling_link], ids=["their-directory", "a-file", "a-dangling-link"]
)
def test_a_squatted_root_name_gives_a_fallback_root_and_a_relaunch_resumes_from_memory(
    tmp_path: Path, shm: Path, other, squat
) -> None:
    """Issue 41 item 10(b): another user who takes ``lightning-resume-<uid>`` first (a directory, a file, a
    dangling link) no longer turns the tier off: the snapshots go to a fallback root of a random name, said
    once, recorded in the checkpoints, and the relaunch resumes from it (before: "snapshot failed", durable only)."""
    root = Path(memory_root(str(shm)))
    squat(root, other)
    ckpt = tmp_path / "ckpt"
    with pytest.warns(ExactResumeWarning, match=f"{root} .*memory-tier snapshots go to {root}-[0-9a-f]{{16}}") as seen:
        with pytest.raises(RuntimeError, match="crash"):
            _fit(ckpt, shm, "last", crash_at=9)
    assert sum("memory-tier snapshots go to" in str(w.message) for w in seen) == 1  # said once, not per save
    assert not any("snapshot failed" in str(w.message) for w in seen)
    (fallback,) = [p for p in shm.iterdir() if p.name.startswith(f"{root.name}-")]
    assert _mode(fallback) == 0o700 and fallback.stat().st_uid == os.geteuid()
    assert _snapshot_steps(shm) == [8]
    resumed = _fit(ckpt, shm, "last")
    assert resumed.resume_report.tier == "memory" and resumed.resume_report.step == 8


def test_a_recorded_fallback_token_cannot_point_the_tier_elsewhere(shm: Path) -> None:
    assert memory_tier.fallback_root(str(shm), "0123456789abcdef") == f"{memory_root(str(shm))}-0123456789abcdef"
    for edited in ("../../etc", "0123456789abcdef/../x", "", "ABCDEF0123456789"):
        assert memory_tier.fallback_root(str(shm), edited) is None


def _planted_root(shm: Path, real: MemoryStore) -> Path:
    """What the other user prepares: a root of their own holding a valid snapshot of our run and slot."""
    planted = shm / "planted"
    fake = MemoryStore(str(planted), real.key, real.rank, real.world_size, asynchronous=False)
    fake.save({"global_step": 99, "w": torch.full((4096,), 666.0)}, step=99, seq=1, run="r")
    return planted


def test_a_root_swapped_after_its_check_cannot_make_a_load_read_a_planted_snapshot(
    shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 41 item 10(a): the memory dir is writable by others without the sticky bit (a team ramdisk), so
    another user can rename our root away and put theirs in its place. The swap is made at the worst moment,
    once every check of the root and slot has passed and before the snapshot is read; the load still reads our
    snapshot (before: the check was by path, the read by path, and the planted weights were loaded)."""
    os.chmod(shm, 0o777)  # no sticky bit: anyone may rename what is in it
    ours = MemoryStore(memory_root(str(shm)), SLOT, 0, 1, asynchronous=False)
    ours.save(_state(3), step=3, seq=1, run="r")
    root, planted = Path(ours.root), _planted_root(shm, ours)
    swapped: list[bool] = []

    def swap() -> None:
        if not swapped:
            root.rename(shm / "moved-away")
            planted.rename(root)
            swapped.append(True)

    real_open, real_load = getattr(memory_tier, "open_private_dir", None), memory_tier.read.load_file

    def open_then_swap(name, *args, **kwargs):  # after the slot is opened and checked
        fd = real_open(name, *args, **kwargs)
        if name == SLOT:
            swap()
        return fd

    def swap_then_load(*args, **kwargs):  # a load by path: every check passed before it
        swap()
        return real_load(*args, **kwargs)

    monkeypatch.setattr(memory_tier, "open_private_dir", open_then_swap, raising=False)
    monkeypatch.setattr(memory_tier.read, "load_file", swap_then_load)
    loaded = MemoryStore(str(root), SLOT, 0, 1, asynchronous=False).load("r")
    assert swapped, "the root was swapped during the load"
    assert loaded is not None and loaded.step == 3
    assert torch.equal(loaded.checkpoint["w"], _state(3)["w"])
