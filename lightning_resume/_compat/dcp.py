"""Every use of ``torch.distributed.checkpoint`` (DCP) and DTensor internals, in one place (torch 2.13).

The sharded checkpoints need five things DCP keeps private: the record of where a chunk is stored,
loading a checkpoint with no state-dict template, the planner that builds that template from the
metadata, the nested-dict setter its planners use, and the path of the metadata file of a reader; async staging builds a DTensor around a
host buffer without moving it back to the mesh's device. One function or alias each, with file:line.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader as _FsspecReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter as _FsspecWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.tensor import DTensor

EmptyStateDictLoadPlanner = _EmptyStateDictLoadPlanner
"""Builds the whole state from the metadata (default_planner.py:410)."""

StorageInfo = _StorageInfo
"""Where one chunk or value lives in a ``FileSystemWriter`` directory: file, offset, length (filesystem.py:75)."""

FsspecWriter = _FsspecWriter
"""``FileSystemWriter`` over any fsspec URL, scheme kept (_fsspec_filesystem.py:96)."""

FsspecReader = _FsspecReader
"""``FileSystemReader`` over any fsspec URL (_fsspec_filesystem.py:154)."""

__all__ = [
    "EmptyStateDictLoadPlanner",
    "FsspecReader",
    "FsspecWriter",
    "StorageInfo",
    "dtensor_layout",
    "host_dtensor",
    "local_tensor",
    "load_without_template",
    "metadata_path",
    "set_nested",
]


def load_without_template(state: dict[str, Any], reader: Any, planner: Any) -> None:
    """Fill the empty ``state`` from ``reader`` in this one process.

    ``dcp.load`` copies back only the keys the template already has; the empty-template path is DCP's
    private ``_load_state_dict`` (state_dict_loader.py:203), as its own ``dcp_to_torch_save`` does
    (format_utils.py:224).
    """
    _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)


def set_nested(root: Any, path: Any, value: Any) -> None:
    """DCP's nested-dict setter for flattened keys (_traverse.py:120), as ``DefaultLoadPlanner.load_bytes`` uses."""
    set_element(root, path, value)


def metadata_path(reader: FileSystemReader, rank: Any = None) -> os.PathLike:
    """The ``.metadata`` file a ``FileSystemReader`` reads (filesystem.py:921)."""
    return reader._get_metadata_path(rank)


def host_dtensor(source: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor with ``source``'s sharding whose local shard is ``local`` (a host buffer).

    ``DTensor.from_local`` would move ``local`` back to the mesh's device; this is the private
    constructor with the private spec (torch/distributed/tensor/_api.py:321), as DCP's own CPU staging
    does in effect (``_create_cpu_state_dict``, _state_dict_utils.py:447-455).
    """
    return DTensor(local, source._spec, requires_grad=False)


def local_tensor(value: Any) -> Any:
    """This rank's shard of ``value`` as a plain tensor sharing its storage (``DTensor.to_local``, _api.py:490),
    or ``None`` when ``value`` is no DTensor."""
    return value.to_local() if isinstance(value, DTensor) else None


def dtensor_layout(value: DTensor) -> dict[str, Any]:
    """How ``value`` is laid out over its mesh, in plain values: equal records mean this rank's local shard of one
    is in place for the other (global shape and stride, local shape, dtype, placements, the mesh's shape and
    dimension names, and this rank's coordinate in it). Public DTensor and DeviceMesh attributes only."""
    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    return {
        "shape": list(value.shape),
        "stride": list(value.stride()),
        "local_shape": list(value.to_local().shape),
        "dtype": str(value.dtype).replace("torch.", ""),
        "placements": [str(p) for p in value.placements],
        "mesh_shape": list(mesh.shape),
        "mesh_dims": list(mesh.mesh_dim_names or ()),
        "coordinate": list(coordinate) if coordinate is not None else [],
    }
