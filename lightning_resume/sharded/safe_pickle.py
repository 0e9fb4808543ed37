"""Loading a ``torch.distributed.checkpoint`` (DCP) directory without running code from it.

What DCP pickles (torch 2.13, ``torch/distributed/checkpoint``):

1. ``.metadata``: the whole ``Metadata`` object, ``pickle.dump`` in ``FileSystemWriter.finish``
   (filesystem.py:774) and read back with a plain ``pickle.load`` (filesystem.py:930), so a hostile
   file runs any ``__reduce__`` payload. :class:`SafeFileSystemReader` reads it with
   :class:`MetadataUnpickler`, whose ``find_class`` admits only the classes a real metadata file
   names (listed in ``ALLOWED_GLOBALS``); anything else raises ``UnsafeCheckpointError`` before any
   object is built.
2. Every non-tensor value of the state (optimizer ``param_groups``, step counters, ...): ``torch.save``
   into a ``.distcp`` file (default_planner.py:286), read back with ``torch.load(weights_only=False)``
   (default_planner.py:387). :class:`SafeLoadPlanner` reads them with ``weights_only=True``: torch's
   restricted unpickler (containers, numbers, strings, tensors), and turns a refusal into
   ``UnsafeCheckpointError``.
3. Tensors: ``torch.save`` per chunk (filesystem.py:346), already read with ``weights_only=True``
   (filesystem.py:899).

This module owns only those two readers; it does not decide what to load or where from.
"""

from __future__ import annotations

import pickle
from typing import IO, Any, Optional

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from typing_extensions import override

from lightning_resume._compat.dcp import metadata_path, set_nested
from lightning_resume.errors import UnsafeCheckpointError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
ALLOWED_GLOBALS = frozenset(
    {
        (_DCP_METADATA, "Metadata"),
        (_DCP_METADATA, "MetadataIndex"),
        (_DCP_METADATA, "StorageMeta"),
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "TensorStorageMetadata"),
        (_DCP_METADATA, "BytesStorageMetadata"),
        (_DCP_METADATA, "ChunkStorageMetadata"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # maps "torch.strided" to the layout object, nothing else
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }
)


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file, refusing every global outside ``ALLOWED_GLOBALS`` and dtypes."""

    def __init__(self, file: IO[bytes], path: str) -> None:
        super().__init__(file)
        self._path = path

    @override
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            self._path, f"DCP metadata names {module}.{name}, which is not a DCP metadata class (a pickle payload?)"
        )


def load_metadata(path: str) -> Metadata:
    """Read a DCP ``.metadata`` file with the allowlist; any malformed content is ``UnsafeCheckpointError``."""
    with open(path, "rb") as handle:
        try:
            metadata = MetadataUnpickler(handle, str(path)).load()
        except UnsafeCheckpointError:
            raise
        except Exception as err:  # a truncated or garbled pickle: refuse, never half-load
            raise UnsafeCheckpointError(str(path), f"DCP metadata does not unpickle: {err}") from err
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(str(path), f"DCP metadata holds a {type(metadata).__name__}, not a Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` uses :func:`load_metadata` instead of ``pickle.load``."""

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = load_metadata(str(metadata_path(self, kwargs.get("rank"))))
        # getattr: metadata pickled by an older torch may lack the attribute
        storage_meta: Optional[StorageMeta] = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = StorageMeta()
            metadata.storage_meta = storage_meta
        storage_meta.load_id = self.load_id
        storage_meta.checkpoint_id = self.checkpoint_id  # saved as the staging dir: name the real one
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor values with ``torch.load(weights_only=True)``.

    Mirrors ``DefaultLoadPlanner.load_bytes`` (torch/distributed/checkpoint/default_planner.py:384-392),
    whose only change here is ``weights_only``.
    """

    @override
    def load_bytes(self, read_item: Any, value: Any) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(self._checkpoint_id(), f"value {fqn!r} needs code to load: {err}") from err
        if self.flatten_state_dict:
            set_nested(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj

    def _checkpoint_id(self) -> str:
        storage = getattr(self.metadata, "storage_meta", None)
        return str(getattr(storage, "checkpoint_id", None) or "DCP checkpoint")
