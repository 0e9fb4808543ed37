"""Lightning hook: ``ModelParallelStrategy`` whose checkpoints are committed, verified, pickle-free DCP dirs.

Lightning's ``ModelParallelStrategy`` (FSDP2 / tensor parallel, the sharded strategy that runs on
CPU; ``FSDPStrategy`` requires CUDA) writes DCP shards but bypasses ``CheckpointIO``, has no commit
point, stores the rest of the checkpoint as a pickle (``meta.pt``) and reads ``.metadata`` with plain
``pickle``. This subclass keeps its sharding and replaces only the two checkpoint methods with
``save_sharded`` / ``load_sharded``. Its ``checkpoint_io`` verifies and removes directories, so
callbacks that prune or verify through the strategy work unchanged. Thin: all logic is in ``api``.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Dict, Literal, Optional, Union

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_resume.sharded import commit as commits
from lightning_resume.sharded.api import clean_uncommitted, load_meta, load_sharded, save_sharded, verify_sharded


class ShardedCheckpointIO(TorchCheckpointIO):
    """Verification and removal of sharded checkpoint directories (writing is collective: the strategy does it)."""

    def __init__(self, digests: bool = True) -> None:
        self.digests = digests

    def verify_checkpoint(self, path: str) -> None:
        verify_sharded(str(path), self.digests)

    def remove_checkpoint(self, path: Any) -> None:
        path = str(path)
        if os.path.isdir(path):
            commits.discard(path)  # renamed away first: a half-removed directory is never "last"
        else:
            super().remove_checkpoint(path)


class ShardedModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` with committed, verified, pickle-free sharded checkpoints.

    Args:
        data_parallel_size, tensor_parallel_size, process_group_backend, timeout: as in
            ``ModelParallelStrategy``.
        verify_digests: check every file's SHA-256 against the commit marker before loading
            (sizes are always checked).
        clean_stale: before the first save of a run, remove directories next to it that a killed
            save left uncommitted.
    """

    def __init__(
        self,
        data_parallel_size: Union[Literal["auto"], int] = "auto",
        tensor_parallel_size: Union[Literal["auto"], int] = "auto",
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        verify_digests: bool = True,
        clean_stale: bool = True,
    ) -> None:
        super().__init__(data_parallel_size, tensor_parallel_size, True, process_group_backend, timeout)
        self.checkpoint_io = ShardedCheckpointIO(verify_digests)
        self.verify_digests = verify_digests
        self.clean_stale = clean_stale
        self._cleaned = False

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        path = os.path.abspath(str(self.broadcast(str(filepath))))
        self._clean_once(os.path.dirname(path))
        state = {"state_dict": checkpoint.pop("state_dict")}
        for idx, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{idx}"] = optim_state
        save_sharded(state, path, int(checkpoint.get("global_step", 0)), meta=checkpoint)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = os.path.abspath(str(self.broadcast(str(checkpoint_path))))
        module = self.model
        state = {"state_dict": get_model_state_dict(module)}
        for idx, optimizer in enumerate(self.optimizers):
            state[f"optimizer_{idx}"] = get_optimizer_state_dict(module, optimizer)
        load_sharded(state, path, self.verify_digests)
        strict = self.lightning_module.strict_loading
        set_model_state_dict(module, state["state_dict"], options=StateDictOptions(strict=strict))
        for idx, optimizer in enumerate(self.optimizers):
            set_optimizer_state_dict(module, optimizer, state[f"optimizer_{idx}"])
        return load_meta(path)

    def _clean_once(self, root: str) -> None:
        if self.clean_stale and not self._cleaned and self.is_global_zero:
            clean_uncommitted(root)
        self._cleaned = True
