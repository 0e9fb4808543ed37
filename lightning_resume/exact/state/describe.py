"""A human summary of the state ``ExactResume`` stores in a checkpoint (for ``lightning-resume inspect``).

Reads the plain values only; knows the layout ``ExactResume.state_dict`` writes, nothing else.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from lightning_resume._compat.torchdata import describe_position


def describe_exact_state(state: Any) -> Optional[dict[str, Any]]:
    """What the saved ExactResume state holds, or ``None`` if ``state`` is not one."""
    if not isinstance(state, Mapping) or "ranks" not in state:
        return None
    return {
        "format": state.get("format"),
        "world_size": state.get("world_size"),
        "saved_at": state.get("saved_at"),
        "schedule_saves": (state.get("schedule") or {}).get("saves"),
        "ranks": [_rank(r) for r in state.get("ranks") or []],
    }


def _rank(rank: Any) -> dict[str, Any]:
    rank = rank if isinstance(rank, Mapping) else {}
    rng = rank.get("rng") if isinstance(rank.get("rng"), Mapping) else {}
    streams = [name for name in ("python", "numpy", "torch") if name in rng]
    streams += [f"cuda x{len(rng['cuda'])}"] if rng.get("cuda") else []
    loaders = rank.get("loaders") or []
    return {
        "rank": rank.get("rank"),
        "rng_streams": streams,
        "loader_positions": [describe_position(s) for s in loaders],
        "prefetched_batches": len(rank.get("prefetched") or []),
        "epoch_exhausted": rank.get("epoch_exhausted"),
        "validation_pending": rank.get("validation_pending"),
        "fingerprint": dict(rank.get("fingerprint") or {}),
    }
