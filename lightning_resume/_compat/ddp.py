"""The private names of torch's ``DistributedDataParallel`` the package relies on (torch 2.13), one function each.

All of them concern the reducer's gradient buckets (``torch/nn/parallel/distributed.py``, cited by line):
DDP builds its reducer with one bucket per size limit in parameter order, and after the first backward
that all-reduces it rebuilds the buckets once, in the order the gradients became ready. A fresh process
starts again from the first layout; ``exact.state.ddp_buckets`` uses these to give it the rebuilt one.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

REBUILT = "rebuilt_per_bucket_param_indices"
"""The logging data's record of the rebuilt layout: each bucket's parameter indices, buckets separated by ``", "``
(set by ``Reducer::rebuild_buckets`` through its ``Logger``; read with ``_get_ddp_logging_data``, line 2552)."""


def rebuilt_layout(ddp: DistributedDataParallel) -> Optional[list[list[int]]]:
    """The buckets' parameter indices, bucket by bucket in the order they are reduced, once rebuilt; ``None``
    before any backward (or when DDP never rebuilds them: ``find_unused_parameters=True`` without
    ``static_graph``).

    A rebuild a backward made pending is done now, as the next forward would do it (``reducer._rebuild_buckets()``,
    line 1775; DDP's join hook calls it outside a forward too, line 431): a collective when it rebuilds (rank 0's
    layout is broadcast), so every rank calls this at the same moment. DDP's logger records the rebuilt layout at
    the forward after the rebuild (``logger.set_runtime_stats_and_log()``, line 1757, which samples the first ten
    iterations: the rebuild comes in the second); before that forward, it is asked to record it now."""
    ddp.reducer._rebuild_buckets()
    if REBUILT not in ddp._get_ddp_logging_data() and ddp.logger is not None:
        ddp.logger.set_runtime_stats_and_log()
    text = ddp._get_ddp_logging_data().get(REBUILT)
    if not isinstance(text, str) or not text.strip():
        return None
    return [[int(i) for i in bucket.split()] for bucket in text.split(",")]


def reduces_in_buckets(ddp: DistributedDataParallel) -> bool:
    """Whether DDP's C++ reducer all-reduces the gradients: not with DDP's Python reducer (compiled autograd's
    buckets, line 841) nor when every parameter's all-reduce is delayed (no reducer is built, line 1053)."""
    return getattr(ddp, "reducer", None) is not None and not ddp._use_python_reducer


def cannot_lay_out(ddp: DistributedDataParallel) -> Optional[str]:
    """What keeps :func:`lay_out_buckets` from building this reducer again (``None``: nothing): DDP's own mixed
    precision tells the reducer its parameters' dtype once, at construction (line 1125)."""
    return "DistributedDataParallel(mixed_precision=...)" if ddp.mixed_precision is not None else None


def parameter_count(ddp: DistributedDataParallel) -> int:
    """How many parameters the reducer reduces (``_build_params_for_reducer``, line 1523)."""
    return len(ddp._build_params_for_reducer()[0])


def lay_out_buckets(ddp: DistributedDataParallel, layout: list[list[int]]) -> None:
    """Build the reducer again with ``layout`` (each bucket's parameter indices, in reduction order) instead of
    the first-iteration one, before any backward: what ``__setstate__`` does (line 1495) with DDP's own
    ``_ddp_init_helper`` (line 1374), its bucket assignment (``dist._compute_bucket_assignment_by_size``, line
    1422) answered with ``layout`` for the call. The old reducer's autograd hooks are removed (line 2619), the
    static graph flag and the Python comm hooks registered on it (``ddp._comm_hooks``, line 1085) carried over.
    The new reducer still rebuilds after its first backward, from the same order: the same layout."""
    parameters, sparse = ddp._build_params_for_reducer()
    names = ddp._build_debug_param_to_name_mapping(parameters)
    limits = [ddp._bucket_config.first_bucket_bytes_cap] + [ddp.bucket_bytes_cap] * (len(layout) - 1)
    hooks = list(ddp._comm_hooks)
    ddp.reducer._remove_autograd_hooks()
    assign = dist._compute_bucket_assignment_by_size
    # _ddp_init_helper reverses the assignment ("the order in which their gradients are produced"): undone here
    dist._compute_bucket_assignment_by_size = lambda *args, **kwargs: (layout[::-1], limits[::-1])
    try:
        ddp._ddp_init_helper(parameters, sparse, names, ddp.static_graph)
    finally:
        dist._compute_bucket_assignment_by_size = assign
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
        if ddp.logger is not None:  # _ddp_init_helper always sets it
            ddp.logger._set_static_graph()
    for hook, state in hooks:
        dist._register_comm_hook(ddp.reducer, state, hook)
