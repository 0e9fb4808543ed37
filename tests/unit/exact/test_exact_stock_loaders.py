"""``adopt``: the loaders users already have, made resumable in place with the same arguments and the same
order; and what is said about the ones that cannot be."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from lightning_resume import ResumableDataset
from lightning_resume.exact.state.data import (
    AdoptedLoaders,
    ResumableDataLoader,
    loader_problems,
    loader_state,
    unsaved_position,
)
from lightning_resume.exact.state.samplers import ResumableRandomSampler


class MyLoader(DataLoader):
    pass


def _data() -> TensorDataset:
    return TensorDataset(torch.arange(10))


def test_plain_dataloader_becomes_resumable_in_place_and_is_put_back() -> None:
    ds = _data()
    g = torch.Generator().manual_seed(3)
    sampler = torch.utils.data.RandomSampler(ds, generator=g)
    loader = DataLoader(ds, batch_size=3, sampler=sampler, drop_last=True, num_workers=2)
    adopted = AdoptedLoaders()
    assert adopted(loader) is loader
    assert type(loader) is ResumableDataLoader and type(sampler) is ResumableRandomSampler
    assert (loader.batch_size, loader.drop_last, loader.num_workers, loader.dataset) == (3, True, 2, ds)
    assert loader.batch_sampler.sampler is sampler and sampler.generator is g
    assert isinstance(next(iter(loader))[0], torch.Tensor)
    assert loader_state(loader) is not None  # the position is ExactResume's, not Lightning's
    assert unsaved_position("train loader 0", loader) is None and loader_problems("train loader 0", loader) == []
    adopted.release()
    assert type(loader) is DataLoader and type(sampler) is torch.utils.data.RandomSampler


def test_workers_see_the_dataset_wrapped_and_users_their_own() -> None:
    ds = _data()
    loader = DataLoader(ds, batch_size=2, num_workers=1)
    AdoptedLoaders()(loader)
    iterator = iter(loader)
    assert isinstance(iterator._dataset, ResumableDataset) and loader.dataset is ds
    assert [b[0].tolist() for b in iterator] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]


def test_stateful_loader_without_workers_keeps_its_state_for_lightning() -> None:
    loader = StatefulDataLoader(_data(), batch_size=2, shuffle=True)
    AdoptedLoaders()(loader)
    assert isinstance(loader.state_dict(), dict)


def test_distributed_sampler_becomes_stateful_in_place_with_the_same_order() -> None:
    ds = _data()
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=5, drop_last=True)
    sampler.set_epoch(1)
    expected = list(sampler)
    loader = DataLoader(ds, batch_size=2, sampler=sampler)
    AdoptedLoaders()(loader)
    assert type(sampler) is StatefulDistributedSampler and loader.batch_sampler.sampler is sampler
    assert list(sampler) == expected


def test_dataloader_subclass_is_left_as_it_is_and_the_message_says_what_happens() -> None:
    loader = MyLoader(_data(), batch_size=2, shuffle=True)
    AdoptedLoaders()(loader)
    assert type(loader) is MyLoader
    message = unsaved_position("train loader 0", loader)
    assert message is not None and "MyLoader" in message and "fresh iterator" in message


def test_a_generator_is_named() -> None:
    message = unsaved_position("train loader 0", (x for x in range(3)))
    assert message is not None and "train loader 0 is a generator" in message


class Batches:  # a custom batch sampler without state
    batch_size, drop_last = 2, False

    def __iter__(self):
        return iter([[0, 1]])

    def __len__(self) -> int:
        return 1


def test_a_custom_batch_sampler_is_left_and_named() -> None:
    loader = DataLoader(_data(), batch_sampler=Batches())
    AdoptedLoaders()(loader)
    assert type(loader) is DataLoader
    message = unsaved_position("train loader 0", loader)
    assert message is not None and "Batches batch sampler" in message


def test_stateful_subclass_with_workers_names_the_wrapper() -> None:
    class MyStateful(StatefulDataLoader):
        pass

    loader = MyStateful(_data(), batch_sampler=Batches(), num_workers=2)
    AdoptedLoaders()(loader)
    (problem,) = loader_problems("train loader 0", loader)
    assert "ResumableDataset(ds)" in problem


def test_lightnings_wrapper_of_a_plain_order_becomes_a_stateful_distributed_sampler_and_is_put_back() -> None:
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    from torchdata.stateful_dataloader.sampler import RandomSampler as TorchdataRandomSampler

    ds = _data()
    wrapper = DistributedSamplerWrapper(TorchdataRandomSampler(ds), num_replicas=2, rank=0, shuffle=True, seed=3)
    loader = StatefulDataLoader(ds, batch_size=2, sampler=wrapper)
    adopted = AdoptedLoaders()
    adopted(loader)
    assert type(loader.sampler) is StatefulDistributedSampler and loader.batch_sampler.sampler is loader.sampler
    assert loader_problems("train loader 0", loader) == []
    adopted.release()
    assert loader.sampler is wrapper and loader.batch_sampler.sampler is wrapper
