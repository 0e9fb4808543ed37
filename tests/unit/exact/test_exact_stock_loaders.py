"""``resumable_loader``: the loaders users already have, made again so that they resume exactly, with the
same arguments and the same order; and what is said about the ones that cannot be."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler, StatefulDistributedSampler

from lightning_resume import ResumableDataset, ResumableIterableDataset
from lightning_resume.exact.state.data import loader_problems, resumable_loader, unsaved_position


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(6))


class MyLoader(DataLoader):
    pass


def _data() -> TensorDataset:
    return TensorDataset(torch.arange(10))


def test_plain_dataloader_becomes_stateful_with_the_same_arguments() -> None:
    ds = _data()
    g = torch.Generator().manual_seed(3)
    loader = DataLoader(ds, batch_size=3, sampler=torch.utils.data.RandomSampler(ds, generator=g), drop_last=True,
                        num_workers=2)  # fmt: skip
    remade = resumable_loader(loader)
    assert type(remade) is StatefulDataLoader
    assert (remade.batch_size, remade.drop_last, remade.num_workers) == (3, True, 2)
    assert isinstance(remade.dataset, ResumableDataset) and remade.dataset.dataset is ds
    assert isinstance(remade.batch_sampler.sampler, RandomSampler)
    assert remade.batch_sampler.sampler.generator is g
    assert unsaved_position("train loader 0", remade) is None and loader_problems("train loader 0", remade) == []


def test_stateful_loader_without_workers_is_kept() -> None:
    loader = StatefulDataLoader(_data(), batch_size=2, shuffle=True)
    assert resumable_loader(loader) is loader


def test_iterable_with_workers_is_wrapped_and_keeps_its_length_behaviour() -> None:
    remade = resumable_loader(StatefulDataLoader(Stream(), batch_size=2, num_workers=2))
    assert isinstance(remade.dataset, ResumableIterableDataset)
    assert list(remade.dataset) == list(range(6))
    assert remade.dataset.state_dict() is None  # nothing stateful: torchdata replays the stream


def test_distributed_sampler_becomes_stateful_with_the_same_order() -> None:
    ds = _data()
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=5, drop_last=True)
    remade = resumable_loader(StatefulDataLoader(ds, batch_size=2, sampler=sampler))
    new = remade.batch_sampler.sampler
    assert isinstance(new, StatefulDistributedSampler)
    sampler.set_epoch(1)
    new.set_epoch(1)
    assert list(new) == list(sampler)


def test_dataloader_subclass_is_not_remade_and_the_message_says_what_happens() -> None:
    loader = MyLoader(_data(), batch_size=2, shuffle=True)
    assert resumable_loader(loader) is loader
    message = unsaved_position("train loader 0", loader)
    assert message is not None and "MyLoader" in message and "repeating some samples" in message


def test_unwrapped_iterable_message_names_the_iterable_wrapper() -> None:
    class Batches:  # a custom batch sampler: the loader is left as it is
        batch_size, drop_last = 2, False

        def __iter__(self):
            return iter([[0, 1]])

        def __len__(self) -> int:
            return 1

    loader = StatefulDataLoader(_data(), batch_sampler=Batches(), num_workers=2)
    assert resumable_loader(loader) is loader
    (problem,) = loader_problems("train loader 0", loader)
    assert "ResumableDataset(ds)" in problem
