"""One copy for two snapshots (``staging.lending``): a second saver writes the tensors a lender staged at the same
point from the lender's pool, copies the rest itself, and the lender waits for that write before reusing or
freeing its pool. Real savers and real files, compared bit for bit."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from lightning_resume.errors import AsyncWriteWarning
from lightning_resume.format import read
from lightning_resume.staging.async_save import AsyncSaver, commit_staged
from tests.helpers.compare import tensor_bits


def _commit(path, tree_json, staged):  # type: ignore[no-untyped-def]
    commit_staged(path, tree_json, staged, "xxh3-128")


def _state(n: int = 4096) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(n // 2, generator=g)}


def _loaded(path: Path) -> dict:
    return read.load_file(str(path), verify=True).checkpoint


def _pair() -> tuple[AsyncSaver, AsyncSaver]:
    lender, borrower = AsyncSaver(_commit), AsyncSaver(_commit)
    lender.lend_staging()
    return lender, borrower


def test_the_second_snapshot_writes_the_lenders_bytes_and_copies_only_what_it_alone_has(tmp_path: Path) -> None:
    lender, borrower = _pair()
    state = _state()
    lender.save({"state_dict": state, "step": 3}, str(tmp_path / "durable.ckpt"))
    own = torch.arange(7.0)  # a tensor of the second dump alone (e.g. an RNG state made for it)
    second = {"state_dict": dict(state), "rng": own, "record": {"seq": 1}}
    borrower.save_text(borrower.encode(second), str(tmp_path / "memory.st"), borrow=lender.offer)
    borrower.wait()
    lender.wait()
    assert borrower.stats.borrowed_bytes == sum(t.nbytes for t in state.values())
    got = _loaded(tmp_path / "memory.st")
    assert tensor_bits(got["state_dict"]["w"]) == tensor_bits(state["w"])
    assert tensor_bits(got["state_dict"]["b"]) == tensor_bits(state["b"])
    assert torch.equal(got["rng"], own) and got["record"] == {"seq": 1}
    lender.close()
    borrower.close()


def test_a_tensor_written_in_place_since_the_lenders_save_is_copied_not_borrowed(tmp_path: Path) -> None:
    lender, borrower = _pair()
    state = _state()
    lender.save({"state_dict": state}, str(tmp_path / "durable.ckpt"))
    lender.wait()
    with torch.no_grad():
        state["w"].add_(1.0)  # its version counter moves: the lender's copy of it is stale
    borrower.save_text(borrower.encode({"state_dict": state}), str(tmp_path / "memory.st"), borrow=lender.offer)
    borrower.wait()
    assert borrower.stats.borrowed_bytes == state["b"].nbytes
    got = _loaded(tmp_path / "memory.st")["state_dict"]
    assert tensor_bits(got["w"]) == tensor_bits(state["w"]) and tensor_bits(got["b"]) == tensor_bits(state["b"])
    lender.close()
    borrower.close()


def test_a_view_of_the_same_memory_read_another_way_is_not_borrowed(tmp_path: Path) -> None:
    lender, borrower = _pair()
    m = torch.randn(8, 4)
    lender.save({"m": m}, str(tmp_path / "durable.ckpt"))
    borrower.save_text(borrower.encode({"m": m.t()}), str(tmp_path / "memory.st"), borrow=lender.offer)
    borrower.wait()
    assert borrower.stats.borrowed_bytes == 0
    assert torch.equal(_loaded(tmp_path / "memory.st")["m"], m.t())
    lender.close()
    borrower.close()


def test_the_lender_waits_for_the_borrowers_write_before_reusing_its_pool(tmp_path: Path) -> None:
    gate, writing = threading.Event(), threading.Event()

    def held_commit(path, tree_json, staged):  # type: ignore[no-untyped-def]
        writing.set()
        gate.wait(10)
        _commit(path, tree_json, staged)

    lender, borrower = AsyncSaver(_commit), AsyncSaver(held_commit)
    lender.lend_staging()
    state = _state()
    before = {k: tensor_bits(v) for k, v in state.items()}
    lender.save({"state_dict": state}, str(tmp_path / "durable.ckpt"))
    borrower.save_text(borrower.encode({"state_dict": state}), str(tmp_path / "memory.st"), borrow=lender.offer)
    assert writing.wait(10)
    with torch.no_grad():
        for t in state.values():
            t.mul_(2.0)  # the next step changes the state; the lender's next save would overwrite its pool
    saved = threading.Thread(target=lender.save, args=({"state_dict": state}, str(tmp_path / "durable2.ckpt")))
    saved.start()
    saved.join(0.3)
    assert saved.is_alive(), "the lender reused its pool while another saver's write still read it"
    gate.set()
    saved.join(10)
    borrower.wait()
    got = _loaded(tmp_path / "memory.st")["state_dict"]
    assert {k: tensor_bits(v) for k, v in got.items()} == before
    lender.close()
    borrower.close()


def test_a_borrower_of_an_overlapped_snapshot_ends_the_lenders_copy_when_it_waits(tmp_path: Path) -> None:
    """The lender defers the optimizer-written state to its copy thread; the borrower's write reads it only after
    the lender's barrier, which the borrower's ``wait`` runs when no optimizer step has yet."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    lender = AsyncSaver(_commit, overlapped=True)  # its watch knows the optimizers that step from now on
    borrower = AsyncSaver(_commit)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    lender.lend_staging()
    ckpt = {"state_dict": model.state_dict(), "optimizer": opt.state_dict()}
    expected = {k: tensor_bits(v) for k, v in model.state_dict().items()}
    lender.save(ckpt, str(tmp_path / "durable.ckpt"))
    assert lender._copy is not None  # the copy is still deferred
    borrower.save_text(borrower.encode(ckpt), str(tmp_path / "memory.st"), borrow=lender.offer)
    assert borrower.stats.borrowed_bytes > 0
    assert borrower.wait(timeout=120)
    assert lender._copy is None  # the borrower's wait ran the lender's barrier
    got = _loaded(tmp_path / "memory.st")
    assert {k: tensor_bits(v) for k, v in got["state_dict"].items()} == expected
    exp_avg = opt.state_dict()["state"][0]["exp_avg"]
    assert tensor_bits(got["optimizer"]["state"][0]["exp_avg"]) == tensor_bits(exp_avg)
    lender.close()
    borrower.close()


def test_a_failed_lender_copy_fails_the_borrowers_write_not_silently(tmp_path: Path) -> None:
    lender, borrower = _pair()
    state = _state()
    lender.save({"state_dict": state}, str(tmp_path / "durable.ckpt"))
    lender.wait()
    offer = lender.offer
    assert offer is not None
    offer.staged._copied_up_to(0, notify=False)  # as if the lender's copy had failed before any tensor
    offer.staged._abort(RuntimeError("copy failed"))
    borrower.save_text(borrower.encode({"state_dict": state}), str(tmp_path / "memory.st"), borrow=offer)
    with pytest.warns(AsyncWriteWarning, match="memory.st"):
        borrower.wait(timeout=120, on_error="warn")
    assert not (tmp_path / "memory.st").exists()
    lender.close()
    borrower.close()
