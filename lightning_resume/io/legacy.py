"""Reading ``torch.save`` checkpoints without running code: ``torch.load(weights_only=True)`` only.

``weights_only=True`` refuses every pickle global outside torch's allowlist. Lightning checkpoints
need a few more harmless classes (found by loading real Lightning-saved files): ``pathlib`` paths and
``AttributeDict`` in hyper-parameters, ``argparse.Namespace`` from LightningCLI hparams, and the enums
Lightning itself defines. Those, and nothing else, are added for the duration of one load. A file
that still needs another global, such as a ``__reduce__`` payload, is refused with
``UnsafeCheckpointError`` before anything it names is called. This module never passes
``weights_only=False``.
"""

from __future__ import annotations

import argparse
import pathlib
import pickle
import zipfile
from typing import Any, Dict, List

import torch

from lightning_resume.errors import CheckpointCorruptError, UnsafeCheckpointError


def lightning_safe_globals() -> List[Any]:
    """Classes a Lightning checkpoint may hold that are safe to construct while unpickling."""
    from lightning.fabric.utilities.data import AttributeDict
    from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason
    from lightning.pytorch.callbacks.timer import Interval
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
    from lightning.pytorch.utilities.enums import GradClipAlgorithmType

    paths = [pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath, pathlib.WindowsPath]
    enums = [TrainerStatus, TrainerFn, RunningStage, GradClipAlgorithmType, EarlyStoppingReason, Interval]
    return [*paths, AttributeDict, argparse.Namespace, *enums]


def load_legacy(path: str, fileobj: Any, map_location: Any = None) -> Dict[str, Any]:
    """Load a ``torch.save`` file from ``fileobj`` with ``weights_only=True`` and Lightning's allowlist."""
    try:
        with torch.serialization.safe_globals(lightning_safe_globals()):
            loaded = torch.load(fileobj, map_location=_torch_map_location(map_location), weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            path,
            "it is a pickle that needs code outside the safe allowlist to load (torch.load weights_only=True "
            f"refused it). If you trust its source, convert it in a sandbox. Detail: {_first_line(err)}",
        ) from err
    except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile, OSError, KeyError, IndexError) as err:
        raise CheckpointCorruptError(path, f"torch.save file could not be read: {_first_line(err)}") from err
    if not isinstance(loaded, dict):
        raise CheckpointCorruptError(
            path, "torch.save file does not hold a checkpoint dict", "dict", type(loaded).__name__
        )
    return loaded


def _torch_map_location(map_location: Any) -> Any:
    return "cpu" if map_location is None or callable(map_location) else map_location


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    lines = [line for line in text.splitlines() if "Unsupported global" in line or "GLOBAL" in line]
    return (lines[0] if lines else text.splitlines()[0] if text else type(err).__name__).strip()[:300]
