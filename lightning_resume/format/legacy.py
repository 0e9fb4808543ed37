"""Reading ``torch.save`` checkpoints without running code: ``torch.load(weights_only=True)`` only.

``weights_only=True`` refuses every pickle global outside torch's allowlist. Lightning checkpoints
need a few more harmless classes (found by loading real Lightning-saved files): ``pathlib`` paths and
``AttributeDict`` in hyper-parameters, ``argparse.Namespace`` from LightningCLI hparams, the enums
Lightning itself defines, and NumPy scalars (an optimizer or a scheduler may keep ``numpy.float64``
values: rebuilt from a dtype and bytes, nothing called). Those, and nothing else, are added for the
duration of one load. A file that still needs another global (an ``nn.Module`` or a ``functools.partial``
that ``save_hyperparameters()`` stored, a ``__reduce__`` payload) is refused with
``PickledCheckpointError`` naming every such global, before anything it names is called.

Only a caller that says so explicitly (``weights_only=False``: the user's ``trainer.fit(...,
weights_only=False)``, or the CLI's ``--no-weights-only``, for a file they trust) gets a full unpickle, as
``torch.load`` does it; the bounds below still apply first.

Weights-only still builds whatever containers the pickle describes, so three bounds apply before and
after the load (``CheckpointCorruptError`` naming the file and the limit): every zip record must be
stored uncompressed (``torch.save`` never compresses; a deflated ``data.pkl`` can be a bomb) and the
pickle at most ``MAX_PICKLE_BYTES``; the loaded tree, walked as a tree (a pickle memo can make a
1 KB DAG of 2**60 leaves, or a list that contains itself), at most ``codec.MAX_TREE_NODES`` nodes and
``codec.MAX_DEPTH`` deep, so every later walk (inspect, diff, convert, prune) ends.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import pickle
import pickletools
import struct
import zipfile
from typing import Any, Dict, List, Tuple

import torch

from lightning_resume.errors import CheckpointCorruptError, PickledCheckpointError
from lightning_resume.format import codec

MAX_PICKLE_BYTES = 256 << 20
"""Largest pickle record (``data.pkl``) of a ``torch.save`` zip that is read: tensors live in their own
records, so a real checkpoint's pickle is a few hundred bytes per tensor. Raise it by assigning
``lightning_resume.format.legacy.MAX_PICKLE_BYTES`` before loading."""


def lightning_safe_globals() -> List[Any]:
    """Classes a Lightning checkpoint may hold that are safe to construct while unpickling."""
    from lightning.fabric.utilities.data import AttributeDict
    from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason
    from lightning.pytorch.callbacks.timer import Interval
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
    from lightning.pytorch.utilities.enums import GradClipAlgorithmType

    paths = [pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath, pathlib.WindowsPath]
    enums = [TrainerStatus, TrainerFn, RunningStage, GradClipAlgorithmType, EarlyStoppingReason, Interval]
    return [*paths, AttributeDict, argparse.Namespace, *enums, *_numpy_scalar_globals()]


def _numpy_scalar_globals() -> List[Any]:
    """What a pickled NumPy scalar of a numeric or bool dtype names: ``numpy.dtype``, its dtype class
    (``numpy.dtypes.Float64DType``) and the ``scalar`` function that builds it from those bytes."""
    import numpy as np

    multiarray = getattr(np, "_core", None) or np.core  # NumPy 2 moved it; NumPy 1 has np.core only
    dtypes = [type(np.dtype(code)) for code in "?bhilqBHILQefdgFDG"]
    return [multiarray.multiarray.scalar, np.dtype, *dtypes]


def load_legacy(
    path: str, fileobj: Any, map_location: Any = None, mmap: bool = False, weights_only: bool = True
) -> Dict[str, Any]:
    """Load a ``torch.save`` file from ``fileobj`` with ``weights_only=True`` and Lightning's allowlist
    (``PickledCheckpointError`` naming each other global it needs), or, with ``weights_only=False`` (a file
    the caller trusts), unpickled in full.

    ``mmap=True`` (``fileobj`` a local file name) maps the tensors instead of reading them: a look at the
    non-tensor values (the step) costs the pickle, not the file."""
    check_zip(path, fileobj)
    location = _torch_map_location(map_location)
    loaded = (
        _load_weights_only(path, fileobj, location, mmap) if weights_only else _unpickle(path, fileobj, location, mmap)
    )
    if not isinstance(loaded, dict):
        raise CheckpointCorruptError(
            path, "torch.save file does not hold a checkpoint dict", "dict", type(loaded).__name__
        )
    check_tree(path, loaded)
    return loaded


def _load_weights_only(path: str, fileobj: Any, location: Any, mmap: bool) -> Any:
    try:
        with torch.serialization.safe_globals(lightning_safe_globals()):
            return torch.load(fileobj, map_location=location, weights_only=True, mmap=mmap or None)
    except pickle.UnpicklingError as err:
        raise PickledCheckpointError(path, unsafe_globals(fileobj) or [_first_line(err)]) from err
    except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile, OSError, KeyError, IndexError) as err:
        raise CheckpointCorruptError(path, f"torch.save file could not be read: {_first_line(err)}") from err
    except (TypeError, AttributeError) as err:
        # an allowlisted class called with arguments it does not take (``Namespace(1)``): the pickle is
        # malformed, not unsafe (nothing outside the allowlist ran)
        raise CheckpointCorruptError(
            path,
            f"torch.save pickle builds an allowed class from bad arguments: {type(err).__name__}: {_first_line(err)}",
        ) from err
    except Exception as err:
        # (struct.error on a short argument, AssertionError, RecursionError...); only allowlisted code ran
        raise CheckpointCorruptError(
            path, f"torch.save file is malformed: {type(err).__name__}: {_first_line(err)}"
        ) from err


def _unpickle(path: str, fileobj: Any, location: Any, mmap: bool) -> Any:
    """A full unpickle (``weights_only=False``), for a file the caller said it trusts: it imports and calls
    what the file names, so whatever that code raises (a class this process cannot import) names the file."""
    try:
        return torch.load(fileobj, map_location=location, weights_only=False, mmap=mmap or None)
    except Exception as err:
        raise CheckpointCorruptError(
            path, f"unpickling it in full (weights_only=False) failed: {type(err).__name__}: {_first_line(err)}"
        ) from err


def unsafe_globals(fileobj: Any) -> List[str]:
    """The globals a ``torch.save`` zip's pickle names that a weights-only load with Lightning's allowlist
    refuses, read from its opcodes (nothing is built or called); ``[]`` for a file torch cannot list them of
    (the pre-1.6 format, a torch before 2.5)."""
    listing = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if listing is None:
        return []
    try:
        if hasattr(fileobj, "seek"):
            fileobj.seek(0)
        with torch.serialization.safe_globals(lightning_safe_globals()):
            return sorted(listing(fileobj))
    except Exception:  # noqa: BLE001 - a file it cannot list is named by the refusal itself
        return []
    finally:
        if hasattr(fileobj, "seek"):
            fileobj.seek(0)


def check_zip(path: str, fileobj: Any) -> None:
    """Every record stored uncompressed, the pickle within ``MAX_PICKLE_BYTES``; before torch reads any."""
    if not is_zip(path, fileobj):
        return  # the pre-1.6 format: torch reads each storage with the length it declares, bounded by the file
    if hasattr(fileobj, "seek"):
        fileobj.seek(0)
    try:
        with zipfile.ZipFile(fileobj) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, RuntimeError, NotImplementedError) as err:
        raise CheckpointCorruptError(path, f"unreadable torch.save zip archive: {err}") from err
    finally:
        if hasattr(fileobj, "seek"):
            fileobj.seek(0)
    for info in records:
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointCorruptError(
                path, f"torch.save record {info.filename!r} is compressed (torch.save never compresses; a zip bomb?)"
            )
        if info.filename.endswith(".pkl") and info.file_size > MAX_PICKLE_BYTES:
            raise CheckpointCorruptError(
                path,
                f"pickle record {info.filename!r} is larger than MAX_PICKLE_BYTES (raise "
                "lightning_resume.format.legacy.MAX_PICKLE_BYTES to read it)",
                MAX_PICKLE_BYTES,
                info.file_size,
            )
    for info in records:
        if info.filename.endswith(".pkl"):
            _check_hash_spread(path, _read_record(path, fileobj, info))


def is_zip(path: str, fileobj: Any) -> bool:
    """``zipfile.is_zipfile``, except that a malformed end record (which makes it raise, e.g. "zipfiles that
    span multiple disks") is ``CheckpointCorruptError`` naming the file."""
    try:
        return zipfile.is_zipfile(fileobj)
    except (zipfile.BadZipFile, ValueError, struct.error) as err:
        raise CheckpointCorruptError(path, f"unreadable torch.save zip archive: {err}") from err
    finally:
        if hasattr(fileobj, "seek"):
            fileobj.seek(0)


def _read_record(path: str, fileobj: Any, info: zipfile.ZipInfo) -> bytes:
    try:
        with zipfile.ZipFile(fileobj) as archive:
            return archive.read(info)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, RuntimeError, NotImplementedError) as err:
        # RuntimeError: a record flagged encrypted; NotImplementedError: an unknown zip version (torch.save writes neither)
        raise CheckpointCorruptError(path, f"torch.save record {info.filename!r} is unreadable: {err}") from err
    finally:
        if hasattr(fileobj, "seek"):
            fileobj.seek(0)


_NUMBER_OPS = frozenset({"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT"})


def _check_hash_spread(path: str, pickled: bytes) -> None:
    """Refuse a pickle whose numbers share hashes (hash flooding): torch's pure-Python unpickler would take
    n**2 steps to put n such keys in a dict. Scans the opcodes (linear), never builds anything."""
    distinct = set()  # by repr: str hashes are randomised, so this set cannot be flooded itself
    try:
        for op, arg, _ in pickletools.genops(pickled):
            if op.name in _NUMBER_OPS and type(arg) in (int, float) and not _hashes_to_itself(arg):
                distinct.add(f"{type(arg).__name__}:{arg!r}")
    except (ValueError, EOFError) as err:
        raise CheckpointCorruptError(path, f"pickle is malformed: {err}") from err
    if len(distinct) <= codec.MAX_HASH_COLLISIONS:
        return
    by_hash = collections.Counter(hash(_number(text)) for text in distinct)
    value, count = by_hash.most_common(1)[0]
    if count > codec.MAX_HASH_COLLISIONS:
        raise CheckpointCorruptError(
            path,
            f"pickle holds {count} numbers with the same hash {value} (hash flooding?); at most "
            f"MAX_HASH_COLLISIONS={codec.MAX_HASH_COLLISIONS} (raise lightning_resume.format.codec.MAX_HASH_COLLISIONS)",
        )


def _hashes_to_itself(arg: Any) -> bool:
    """Small ints (and integral floats below 2**53) hash to their own value: they cannot collide."""
    if type(arg) is int:
        return abs(arg) < 2**61 - 1
    return type(arg) is float and arg.is_integer() and abs(arg) < 2**53


def _number(text: str) -> Any:
    kind, _, literal = text.partition(":")
    return int(literal) if kind == "int" else float(literal)


def check_tree(path: str, tree: Any) -> None:
    """The loaded tree, counted as the tree every later walk sees: at most ``codec.MAX_TREE_NODES`` nodes
    and ``codec.MAX_DEPTH`` levels (shared containers count each time they are reached)."""
    limit, depth_limit = codec.MAX_TREE_NODES, codec.MAX_DEPTH
    stack: List[Tuple[Any, int]] = [(tree, 0)]
    nodes = 1
    while stack:
        node, depth = stack.pop()
        children = _children(node)
        if not children:
            continue
        nodes += len(children)
        if nodes > limit:
            raise CheckpointCorruptError(
                path,
                "checkpoint tree has more nodes than MAX_TREE_NODES (shared containers count each time they are"
                " reached; raise lightning_resume.format.codec.MAX_TREE_NODES to read it)",
                limit,
                f"> {limit}",
            )
        if depth >= depth_limit:
            raise CheckpointCorruptError(
                path, "checkpoint tree is nested deeper than MAX_DEPTH (a container that holds itself?)", depth_limit
            )
        stack.extend((child, depth + 1) for child in children)


def _children(node: Any) -> List[Any]:
    if isinstance(node, dict):
        return [*node.keys(), *node.values()]
    if isinstance(node, (list, tuple, set, frozenset)):
        return list(node)
    if isinstance(node, argparse.Namespace):
        return list(vars(node).values())
    return []


def _torch_map_location(map_location: Any) -> Any:
    return "cpu" if map_location is None or callable(map_location) else map_location


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    lines = [line for line in text.splitlines() if "Unsupported global" in line or "GLOBAL" in line]
    return (lines[0] if lines else text.splitlines()[0] if text else type(err).__name__).strip()[:300]
