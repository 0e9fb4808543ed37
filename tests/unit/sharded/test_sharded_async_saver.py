"""Async sharded saves in one process: ``AsyncShardedSaver``, ``HostShards`` and the async strategy's IO.
The 2-process FSDP2 and Lightning cases are in tests/integration/test_sharded_async.py."""

from __future__ import annotations

import pytest
import torch

from lightning_resume import load_full, newest_committed
from lightning_resume.errors import ConfigurationError
from lightning_resume.io.sharded_strategy import ShardedModelParallelStrategy
from lightning_resume.protocols import AsyncCheckpointWriter
from lightning_resume.sharded.background import AsyncShardedSaver, HostShards, save_sharded_async

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_async_strategy_io_is_an_async_writer_and_the_sync_one_is_not():
    assert isinstance(ShardedModelParallelStrategy(save="async").checkpoint_io, AsyncCheckpointWriter)
    assert not isinstance(ShardedModelParallelStrategy().checkpoint_io, AsyncCheckpointWriter)
    assert not isinstance(ShardedModelParallelStrategy(save="sync").checkpoint_io, AsyncCheckpointWriter)


@pytest.mark.parametrize(
    "save, fix",
    [("overlapped", "copies every local shard"), (True, "async_save=True is now save='async'"), ("fast", "")],
)
def test_a_save_mode_the_strategy_lacks_is_refused_naming_the_option_and_the_fix(save, fix):
    with pytest.raises(ConfigurationError) as err:
        ShardedModelParallelStrategy(save=save, flush_timeout="soon")
    message = str(err.value)
    assert f"save={save!r} is not supported; use one of ['sync', 'async']" in message and fix in message
    assert "flush_timeout" in message  # every problem at once


def test_host_buffers_are_reused_and_copies_include_scalars():
    shards, weight, step = HostShards(), torch.arange(6.0).reshape(2, 3), torch.tensor(3.0)
    first = shards.stage({"m": {"w": weight}, "o": {"step": step, "groups": [{"lr": 0.1}]}})
    pointer = first["m"]["w"].data_ptr()
    weight.add_(1)
    step.add_(1)
    assert first["m"]["w"][0, 0].item() == 0.0 and first["o"]["step"].item() == 3.0  # copies, not views
    second = shards.stage({"m": {"w": weight}, "o": {"step": step, "groups": [{"lr": 0.1}]}})
    assert second["m"]["w"].data_ptr() == pointer and second["m"]["w"][0, 0].item() == 1.0  # same buffer
    third = shards.stage({"m": {"w": torch.zeros(4)}, "o": {"step": step, "groups": []}})
    assert third["m"]["w"].shape == (4,) and shards.nbytes == 4 * 4 + 4  # reallocated for the new shape


def test_one_process_async_save_is_not_newest_until_committed(tmp_path):
    saver = AsyncShardedSaver()
    handle = save_sharded_async({"w": torch.ones(3)}, str(tmp_path / "a"), 1, meta={"step": 1}, saver=saver)
    assert newest_committed(str(tmp_path)) is None and saver.write_in_flight(str(tmp_path / "a"))
    assert handle.wait() and handle.committed and not saver.write_in_flight(str(tmp_path / "a"))
    assert newest_committed(str(tmp_path)) == str(tmp_path / "a") and saver.last_write_seconds is not None
    saver.save({"w": torch.zeros(3)}, str(tmp_path / "a"), 2)  # re-save under the same name
    assert torch.equal(load_full(str(tmp_path / "a"))["w"], torch.ones(3))  # the committed one is untouched
    saver.close()
    assert torch.equal(load_full(str(tmp_path / "a"))["w"], torch.zeros(3))
