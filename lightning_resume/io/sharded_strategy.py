"""Lightning hook: ``ModelParallelStrategy`` whose checkpoints are committed, verified, pickle-free DCP dirs.

Lightning's ``ModelParallelStrategy`` (FSDP2 / tensor parallel, the sharded strategy that runs on
CPU; ``FSDPStrategy`` requires CUDA) writes DCP shards but bypasses ``CheckpointIO``, has no commit
point, stores the rest of the checkpoint as a pickle (``meta.pt``) and reads ``.metadata`` with plain
``pickle``. This subclass keeps its sharding and replaces only the two checkpoint methods with
``save_sharded`` / ``load_sharded``, on a local directory or any fsspec URL (``s3://``). Its
``checkpoint_io`` verifies and removes directories, so callbacks that prune or verify through the strategy work
unchanged. With ``save="async"`` saves go through ``background.AsyncShardedSaver`` and the ``checkpoint_io`` is
also an ``AsyncCheckpointWriter`` (``lightning_resume.protocols``), so ``ExactResume`` and ``RetentionCheckpoint``
treat the directory as in flight until its commit. Thin: all logic is in ``api`` and ``background``.
"""

import sys
from datetime import timedelta
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Union

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_resume._compat import check_versions
from lightning_resume.durations import Duration, parse_duration
from lightning_resume.errors import CheckpointCorruptError, ConfigurationError
from lightning_resume.io.resolve import newest_verified
from lightning_resume.io.verify import verify
from lightning_resume.sharded import commit as commits
from lightning_resume.sharded import local
from lightning_resume.sharded.api import checkpoint_path as sharded_path  # load_checkpoint's argument has the name
from lightning_resume.sharded.api import clean_uncommitted, load_meta, load_sharded, save_sharded
from lightning_resume.sharded.background import AsyncShardedSaver
from lightning_resume.sharded.marker import MARKER, named_for_lightning
from lightning_resume.sharded.verify import verify_directory
from lightning_resume.storage import files as storage

ShardedSaveMode = Literal["sync", "async"]
"""When a sharded save copies the local shards: ``"sync"``, never (the save returns once the directory is
committed); ``"async"``, into reusable host buffers, then the write runs in the background. The values mean
what they mean for ``SafetensorsCheckpointIO(save=...)``, which adds ``"overlapped"``."""

SHARDED_SAVE_MODES = ("sync", "async")


def lightning_path(directory: str) -> str:
    """What ``ckpt_path="last"`` hands Lightning for a checkpoint directory (``sharded.marker.named_for_lightning``):
    the directory itself, or on an object store its commit marker; :func:`directory_of` maps it back."""
    return named_for_lightning(directory)


def directory_of(path: str) -> str:
    """The checkpoint a path from :func:`lightning_path` names (any other path unchanged)."""
    parent, name = storage.split(str(path))
    return parent if name == MARKER and storage.is_remote(str(path)) else str(path)


class ShardedCheckpointIO(TorchCheckpointIO):
    """Verification and removal of sharded checkpoint directories (writing is collective: the strategy does it).

    Also a ``ResolvingCheckpointIO``: "last" is the newest candidate that verifies in full, named for Lightning
    by :func:`lightning_path`; ``loaded_path`` names the directory again (the resume source retention keeps).
    """

    def __init__(self, digests: bool = True) -> None:
        self.digests = digests

    def verify_checkpoint(self, path: str) -> None:
        verify_directory(str(path), self.digests)

    def resolve_newest(
        self, paths: Sequence[str], skipped: Callable[[str], None], weights_only: bool = True
    ) -> Optional[str]:
        """The newest of ``paths`` that verifies (``io.resolve.newest_verified``), as Lightning can time it.
        ``weights_only`` changes nothing: a sharded checkpoint's pickles are read weights-only (``sharded.safe_pickle``)."""
        path = newest_verified(paths, lambda p: verify(p, self, self.digests), skipped=skipped)
        return None if path is None else lightning_path(path)

    def loaded_path(self, path: str) -> str:
        return directory_of(path)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        path = str(path)
        if storage.is_dir(path):
            commits.discard(path)  # renamed away first: a half-removed directory is never "last"
        else:
            super().remove_checkpoint(path)


class AsyncShardedCheckpointIO(ShardedCheckpointIO):
    """``ShardedCheckpointIO`` that reports the strategy's background writes (``AsyncCheckpointWriter``).

    ``write_in_flight(path)`` is true until ``path`` is committed; ``write_in_flight()`` while this
    rank's write runs. ``wait`` is collective (every rank calls it, as Lightning's hooks do): it
    commits the pending save.
    """

    def __init__(self, saver: AsyncShardedSaver, digests: bool, flush_timeout: float) -> None:
        super().__init__(digests)
        self.saver = saver
        self.flush_timeout = flush_timeout

    def write_in_flight(self, path: Optional[str] = None) -> bool:
        return self.saver.write_in_flight(path)

    def wait(self, path: Optional[str] = None, timeout: Optional[float] = None) -> bool:
        return self.saver.wait(timeout)

    @property
    def last_blocked_seconds(self) -> Optional[float]:
        """Training-thread time of the newest save after waiting for the one before: staging and copying."""
        return self.saver.last_blocked_seconds

    @property
    def last_wait_seconds(self) -> Optional[float]:
        """How long the newest save waited for (and committed) the one before it."""
        return self.saver.last_wait_seconds

    @property
    def last_write_seconds(self) -> Optional[float]:
        """Background time of the newest committed write (slowest rank: DCP write, fsync, digests)."""
        return self.saver.last_write_seconds


class ShardedModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` with committed, verified, pickle-free sharded checkpoints.

    Args:
        data_parallel_size, tensor_parallel_size, process_group_backend, timeout: as in
            ``ModelParallelStrategy``.
        verify_digests: check every file's SHA-256 against the commit marker before loading
            (sizes are always checked).
        clean_stale: before the first save of a run, remove directories next to it that a killed
            save left uncommitted.
        save: when a save copies the local shards, and so how long it blocks training. ``"sync"`` (default):
            the save returns once the directory is committed. ``"async"``: the save copies the local shards
            into reusable host buffers and returns; the write runs on a background thread and is committed
            at the next save, :meth:`wait_for_checkpoint` or teardown (at most one write in flight).
        flush_timeout: with ``save="async"``, the longest wait for the pending write at teardown; a
            duration (seconds, ``timedelta`` or a string such as ``"10min"``).
    """

    def __init__(
        self,
        data_parallel_size: Union[Literal["auto"], int] = "auto",
        tensor_parallel_size: Union[Literal["auto"], int] = "auto",
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        verify_digests: bool = True,
        clean_stale: bool = True,
        save: ShardedSaveMode = "sync",
        flush_timeout: Duration = "10min",
    ) -> None:
        check_versions("lightning", "torchdata", "torch")
        problems = _save_problems(save)
        try:
            self.flush_timeout = parse_duration(flush_timeout, "flush_timeout")
        except ValueError as err:
            problems.append(str(err))
        if problems:
            raise ConfigurationError(type(self).__name__, problems)
        super().__init__(data_parallel_size, tensor_parallel_size, True, process_group_backend, timeout)
        self.save = save
        self.saver = AsyncShardedSaver(timeout) if save == "async" else None
        self.checkpoint_io = (
            AsyncShardedCheckpointIO(self.saver, verify_digests, self.flush_timeout)
            if self.saver
            else ShardedCheckpointIO(verify_digests)
        )
        self.verify_digests = verify_digests
        self.clean_stale = clean_stale
        self._cleaned = False

    @override
    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        path = sharded_path(str(self.broadcast(str(filepath))))
        self._clean_once(storage.split(path)[0])
        state = {"state_dict": checkpoint.pop("state_dict")}
        for idx, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{idx}"] = optim_state
        step = int(checkpoint.get("global_step", 0))
        if self.saver is not None:
            self.saver.save(state, path, step, meta=checkpoint)
        else:
            save_sharded(state, path, step, meta=checkpoint)

    def wait_for_checkpoint(self, timeout: Optional[float] = None) -> bool:
        """Collective: wait for the background write and commit it (raising its failure); ``False`` on timeout."""
        return True if self.saver is None else self.saver.wait(timeout)

    @override
    def teardown(self) -> None:
        """Commit the pending write within ``flush_timeout`` (raising a failure, naming the directory).

        Inside an exception handler (Lightning tears down after an exception) other ranks may be gone,
        so no collective runs: the write gets ``flush_timeout`` to end and stays uncommitted.
        """
        try:
            if self.saver is not None and sys.exc_info()[1] is not None:
                self.saver.abandon(self.flush_timeout)
            elif self.saver is not None:
                self.saver.close(self.flush_timeout)
        finally:
            super().teardown()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        path = sharded_path(directory_of(str(self.broadcast(str(checkpoint_path)))))
        self.wait_for_checkpoint()  # a directory still being written is not loadable yet
        record = self._restore(lambda state: load_sharded(_dcp_keys(state), path, self.verify_digests))
        meta = load_meta(path, record)  # the same save as the shards, even if "last" was re-saved meanwhile
        if meta is None:
            raise CheckpointCorruptError(
                path,
                "has no Lightning checkpoint data (saved by save_sharded without meta?); load it with load_sharded",
            )
        return meta

    def memory_snapshot(self, checkpoint: Dict[str, Any]) -> Dict[str, Any]:
        """The memory tier's snapshot of this rank (``protocols.LocalShardSnapshots``): its local shards."""
        return local.to_local(checkpoint)

    def check_local(self, checkpoint: Dict[str, Any]) -> List[str]:
        """What keeps a memory snapshot from restoring this rank now (``sharded.local.check``). Building the layout
        initializes the state of an optimizer that has none (torch takes a zero-lr step): when the snapshot is
        refused, that state is cleared again, so a fresh start that follows starts from nothing, as it would have."""
        fresh = [optimizer for optimizer in self.optimizers if not optimizer.state]
        problems = local.check(self._template(), checkpoint)
        if problems:
            for optimizer in fresh:
                optimizer.state.clear()
        return problems

    def restore_local(self, checkpoint: Dict[str, Any]) -> Dict[str, Any]:
        """Restore the model and optimizers from a memory snapshot's local shards, in place; the rest of the
        checkpoint, as :meth:`load_checkpoint` returns a durable one's meta."""
        self._restore(lambda state: local.fill(state, checkpoint))
        return local.without_shards(checkpoint)

    def _template(self) -> Dict[str, Any]:
        """The model's and optimizers' state now, as Lightning's checkpoint holds them (``state_dict``,
        ``optimizer_states``): the layout a restore fills in place."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        module = self.model
        # Lightning restores a checkpoint into this strategy only after setup (restore_checkpoint_after_setup)
        assert module is not None and self.lightning_module is not None
        optimizers = [get_optimizer_state_dict(module, optimizer) for optimizer in self.optimizers]
        return {"state_dict": get_model_state_dict(module), "optimizer_states": optimizers}

    def _restore(self, fill: Callable[[Dict[str, Any]], Any]) -> Any:
        """Fill the state template (:meth:`_template`) with ``fill``, then apply it to the model and optimizers;
        what ``fill`` returned."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        state = self._template()
        out = fill(state)
        assert self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        set_model_state_dict(self.model, state["state_dict"], options=StateDictOptions(strict=strict))  # type: ignore[arg-type]
        for optimizer, optimizer_state in zip(self.optimizers, state["optimizer_states"], strict=True):
            set_optimizer_state_dict(self.model, optimizer, optimizer_state)  # type: ignore[arg-type]
        return out

    def _clean_once(self, root: str) -> None:
        if self.clean_stale and not self._cleaned and self.is_global_zero:
            clean_uncommitted(root)
        self._cleaned = True


def _dcp_keys(state: Dict[str, Any]) -> Dict[str, Any]:
    """:meth:`ShardedModelParallelStrategy._template` as the sharded checkpoint names its parts (``optimizer_<i>``):
    the same dicts, so that a load into this fills that."""
    optimizers = {f"optimizer_{idx}": o for idx, o in enumerate(state["optimizer_states"])}
    return {"state_dict": state["state_dict"], **optimizers}


def _save_problems(save: Any) -> List[str]:
    """What is wrong with a ``save`` argument, named with its value and the fix (empty: nothing)."""
    if isinstance(save, str) and save in SHARDED_SAVE_MODES:
        return []
    hints = {
        True: " (async_save=True is now save='async')",
        False: " (async_save=False is now save='sync')",
        "overlapped": " (a sharded save copies every local shard before it returns)",
    }
    hint = hints.get(save, "") if isinstance(save, (bool, str)) else ""
    return [f"save={save!r} is not supported; use one of {list(SHARDED_SAVE_MODES)}{hint}"]
