"""A rank's local shards as a plain checkpoint: what the memory tier keeps of a sharded run, one file per rank.

Under the sharded strategy (FSDP2, tensor parallel) the checkpoint Lightning builds on each rank holds DTensors
under ``state_dict`` and ``optimizer_states``. :func:`to_local` replaces each with this rank's local shard, a plain
tensor that any per-rank file holds (``format``), and records under :data:`LOCAL_SHARDS_KEY` how each was laid
out: the global shape and stride, the local shape, dtype, placements, the mesh and this rank's place in it.
:func:`check` names every path whose layout, dtype or presence differs between that record and the state the run
has now (another mesh at the same world size, another model); :func:`fill` copies the saved shards into that state
in place. Loading them back is only right on the same mesh: another one goes through the durable, resharding
checkpoint. Knows tensors and DTensors (through ``_compat.dcp``), not Lightning, files or process groups.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Mapping, Tuple

import torch

from lightning_resume._compat.dcp import dtensor_layout, local_tensor

LOCAL_SHARDS_KEY = "lightning_resume_local_shards"
"""Key of the layout record in a checkpoint of local shards: ``{path: layout}`` for every DTensor it replaced."""

SHARDED_KEYS = ("state_dict", "optimizer_states")
"""The parts of Lightning's checkpoint that hold sharded tensors under the sharded strategy."""

Path = Tuple[Any, ...]


def to_local(checkpoint: Mapping[str, Any]) -> Dict[str, Any]:
    """``checkpoint`` with every DTensor under :data:`SHARDED_KEYS` replaced by its local shard (sharing its
    storage: nothing is copied here) and the layout record added; the other entries as they are."""
    layouts: Dict[str, Any] = {}
    out = dict(checkpoint)
    for key in SHARDED_KEYS:
        if key in out:
            out[key] = _localized(out[key], (key,), layouts)
    out[LOCAL_SHARDS_KEY] = layouts
    return out


def _localized(node: Any, path: Path, layouts: Dict[str, Any]) -> Any:
    local = local_tensor(node)
    if local is not None:
        layouts[name(path)] = dtensor_layout(node)
        return local
    if isinstance(node, dict):
        return {k: _localized(v, (*path, k), layouts) for k, v in node.items()}
    if isinstance(node, list):
        return [_localized(v, (*path, i), layouts) for i, v in enumerate(node)]
    return node


def name(path: Path) -> str:
    """How a path in the checkpoint is named in the record and in messages: its keys joined by ``/``."""
    return "/".join(str(part) for part in path)


def check(template: Mapping[str, Any], saved: Mapping[str, Any]) -> List[str]:
    """What keeps ``saved`` (a checkpoint of local shards, :func:`to_local`) from filling ``template`` (the
    run's state now, in the same shape: DTensors or tensors under :data:`SHARDED_KEYS`), one line per path;
    empty when every tensor of each is in the other with the same layout, dtype and shape."""
    record = saved.get(LOCAL_SHARDS_KEY)
    if not isinstance(record, Mapping):
        return [f"no {LOCAL_SHARDS_KEY} record: not a snapshot of local shards"]
    wanted = dict(_tensors(template))
    have = dict(_tensors(saved))
    problems = [f"{p}: not in the snapshot" for p in wanted if p not in have]
    problems += [f"{p}: in the snapshot, not in this run's state" for p in have if p not in wanted]
    for path in (p for p in wanted if p in have):
        problems += _differs(path, wanted[path], have[path], record.get(path))
    return problems


def _differs(path: str, now: Any, tensor: torch.Tensor, layout: Any) -> List[str]:
    """``[]`` if the saved ``tensor`` (with its recorded ``layout``, if it was a DTensor) fits ``now``."""
    if local_tensor(now) is None:
        if layout is not None:
            return [f"{path}: saved as a shard ({layout.get('placements')}), a whole tensor now"]
        same = (now.dtype, tuple(now.shape)) == (tensor.dtype, tuple(tensor.shape))
        return (
            [] if same else [f"{path}: {tensor.dtype} {tuple(tensor.shape)} saved, {now.dtype} {tuple(now.shape)} now"]
        )
    expected = dtensor_layout(now)
    if layout is None:
        return [f"{path}: saved as a whole tensor, a shard ({expected['placements']}) now"]
    recorded = _plain(layout)
    if recorded != expected:
        diff = [f"{k} {recorded.get(k)} saved, {v} now" for k, v in expected.items() if recorded.get(k) != v]
        return [f"{path}: {', '.join(diff)}"]
    if tuple(tensor.shape) != tuple(expected["local_shape"]) or str(tensor.dtype) != f"torch.{expected['dtype']}":
        return [f"{path}: the saved local shard is {tensor.dtype} {tuple(tensor.shape)}, its record says otherwise"]
    return []


def fill(template: Dict[str, Any], saved: Mapping[str, Any]) -> None:
    """Copy ``saved``'s local shards into ``template``'s DTensors' local shards and its tensors into the
    template's tensors, in place; every other value of ``saved`` (optimizer ``param_groups``, ...) is put in the
    template's dicts and lists in place of theirs. Call :func:`check` first: this copies, it does not compare."""
    for key in SHARDED_KEYS:
        if key in saved and key in template:
            template[key] = _filled(template[key], saved[key])


def _filled(now: Any, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        target = local_tensor(now)
        target = now if target is None else target
        with torch.no_grad():
            target.copy_(value)
        return now
    if isinstance(value, dict) and isinstance(now, dict):
        for k, v in value.items():
            now[k] = _filled(now.get(k), v)
        return now
    if isinstance(value, list) and isinstance(now, list) and len(value) == len(now):
        for i, v in enumerate(value):
            now[i] = _filled(now[i], v)
        return now
    return value


def without_shards(checkpoint: Mapping[str, Any]) -> Dict[str, Any]:
    """``checkpoint`` less its sharded parts and their record: what a sharded checkpoint's meta file holds."""
    return {k: v for k, v in checkpoint.items() if k not in (*SHARDED_KEYS, LOCAL_SHARDS_KEY)}


def _tensors(tree: Mapping[str, Any]) -> Iterator[Tuple[str, Any]]:
    """``(path, tensor or DTensor)`` for every one under :data:`SHARDED_KEYS`."""
    for key in SHARDED_KEYS:
        if key in tree:
            yield from _walk(tree[key], (key,))


def _walk(node: Any, path: Path) -> Iterator[Tuple[str, Any]]:
    if isinstance(node, torch.Tensor):
        yield name(path), node
    elif isinstance(node, Mapping):
        for k, v in node.items():
            yield from _walk(v, (*path, k))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _walk(v, (*path, i))


def _plain(value: Any) -> Any:
    """A decoded record as :func:`dtensor_layout` builds it (tuples as lists)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
