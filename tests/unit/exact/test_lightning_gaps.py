"""The loader half of the ``CombinedLoader(mode="max_size")`` compensation, on real torchdata loaders.

A loader that ran out in the saved epoch has a finished position. ``hold_finished_position`` applies it as the
saving run held it (a finished iterator), so its next ``iter`` starts the next epoch with the order and the global
RNG draw of the uninterrupted loader; left pending, torchdata makes two iterators there (one more RNG draw).
"""

from __future__ import annotations

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_resume._compat.torchdata import hold_finished_position, iterator_finished


def _loader() -> StatefulDataLoader:
    return StatefulDataLoader(list(range(10)), batch_size=4, shuffle=True)


def _next_epoch(loader: StatefulDataLoader) -> tuple[list[list[int]], torch.Tensor]:
    """The next epoch's batches and a draw of the global RNG right after its iterator was made."""
    it = iter(loader)
    after = torch.randint(0, 2**30, (1,))
    return [b.tolist() for b in it], after


def _run_out(loader: StatefulDataLoader) -> dict:
    for _ in loader:
        pass
    return loader.state_dict()


def test_a_finished_position_is_told_from_one_at_its_last_batch() -> None:
    loader = _loader()
    it = iter(loader)
    for _ in range(3):  # every batch yielded, StopIteration not yet raised
        next(it)
    assert not iterator_finished(loader.state_dict())
    assert iterator_finished(_run_out(loader))
    assert not iterator_finished(None)


def test_a_held_finished_position_starts_the_next_epoch_as_the_uninterrupted_loader() -> None:
    torch.manual_seed(0)
    uninterrupted = _loader()
    state = _run_out(uninterrupted)
    rng = torch.random.get_rng_state()
    expected = _next_epoch(uninterrupted)

    held, pending = _loader(), _loader()
    for resumed, hold in ((held, True), (pending, False)):
        resumed.load_state_dict(state)
        if hold:
            hold_finished_position(resumed)
        torch.random.set_rng_state(rng)
        got = _next_epoch(resumed)
        if hold:
            assert got[0] == expected[0] and torch.equal(got[1], expected[1])
        else:  # the control: left pending, the next epoch draws once more from the global RNG
            assert not torch.equal(got[1], expected[1])
