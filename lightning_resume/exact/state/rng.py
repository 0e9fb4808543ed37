"""Every random number stream of one process: capture and restore.

Streams: Python ``random``, NumPy's global generator, torch CPU and every initialised CUDA device
(a generator registered with ``ExactResume(state=...)`` is saved with the other user state, ``state.user``).
The captured value holds only tensors, ints, floats, strings, lists and dicts, so it loads with
``torch.load(weights_only=True)`` and encodes without pickle. This module knows nothing about Lightning.
"""

from __future__ import annotations

import random
from typing import Any, Mapping

import numpy as np
import torch

RngState = dict[str, Any]


def _python_state() -> dict[str, Any]:
    version, internal, gauss_next = random.getstate()
    return {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next}


def _set_python_state(state: Mapping[str, Any]) -> None:
    internal = tuple(int(x) for x in state["state"].tolist())
    random.setstate((state["version"], internal, state["gauss_next"]))


def _numpy_state() -> dict[str, Any]:
    st = np.random.get_state(legacy=False)
    return {
        "bit_generator": st["bit_generator"],
        "key": torch.from_numpy(st["state"]["key"].astype(np.int64)),
        "pos": int(st["state"]["pos"]),
        "has_gauss": int(st["has_gauss"]),
        "gauss": float(st["gauss"]),
    }


def _set_numpy_state(state: Mapping[str, Any]) -> None:
    np.random.set_state(
        {
            "bit_generator": state["bit_generator"],
            "state": {"key": state["key"].numpy().astype(np.uint32), "pos": int(state["pos"])},
            "has_gauss": int(state["has_gauss"]),
            "gauss": float(state["gauss"]),
        }
    )


def _cuda_states() -> list[torch.Tensor]:
    # Only devices already initialised: querying CUDA must not create a context as a side effect.
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return []
    return [s.clone() for s in torch.cuda.get_rng_state_all()]


def capture_rng() -> RngState:
    """Return the state of every stream of this process (values are copies)."""
    return {
        "python": _python_state(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state().clone(),
        "cuda": _cuda_states(),
    }


def rng_mismatches(state: RngState) -> list[str]:
    """Differences that make ``restore_rng(state)`` impossible, one line each."""
    problems = []
    n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if state.get("cuda") and len(state["cuda"]) > n_cuda:
        problems.append(f"checkpoint has {len(state['cuda'])} CUDA RNG streams, this process sees {n_cuda} devices")
    return problems


def restore_rng(state: RngState) -> None:
    """Set every stream to ``state``. Streams absent from this run are left alone (see ``rng_mismatches``)."""
    _set_python_state(state["python"])
    _set_numpy_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        for device, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, device)


def reseed(seed: int) -> None:
    """Seed every stream from ``seed``: Python ``random``, NumPy, torch CPU and every CUDA device
    (``torch.manual_seed``)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
