"""The Lightning side of activation checkpointing: strategies that apply a plan during setup.

Why strategy subclasses. Lightning 2.6 calls ``LightningModule.configure_model`` from
``Trainer._run`` and only then ``strategy.setup``, which converts precision, moves the model to
the device and calls ``strategy._setup_model(model)``: the identity for ``SingleDeviceStrategy``,
the ``DistributedDataParallel`` wrap for ``DDPStrategy`` (fitting only), the FSDP wrap for
``FSDPStrategy`` (strategy.py:141-156, ddp.py:158-196, fsdp.py:291-352). Overriding
``_setup_model`` is therefore the one place that runs after every layer exists and before any
wrapper or compiled graph is built, whatever the strategy. A callback has no hook there, and a
wrapper around a strategy would hide its type from Lightning's accelerator connector (which picks
launchers, devices and precision by ``isinstance``). A subclass keeps every argument of the base
strategy, so it is one line in Python and a ``class_path`` in LightningCLI YAML, and the
LightningModule does not change.

This module only gathers inputs (module records, one measured forward), asks the policy, logs the
plan and calls the mechanism. Under FSDP it hands the chosen blocks to FSDP's own
``activation_checkpointing`` (whose wrapper strips its prefix from state-dict keys).
"""

import importlib
from typing import Any, Optional, Sequence, Union

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy, Strategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_resume._compat import check_versions
from lightning_resume._compat.lightning import ModelSetupHook, set_fsdp_checkpoint_fn
from lightning_resume.activation.apply import (
    apply_plan,
    keeps_output,
    remove_activation_checkpointing,
    resolve_save_ops,
)
from lightning_resume.activation.measure import (
    RecomputeCosts,
    SavedBytes,
    block_records,
    measure_recompute,
    measure_saved_bytes,
)
from lightning_resume.activation.policy import (
    DEFAULT_SAVE_OPS,
    OWNER,
    BlockSelection,
    CheckpointPlan,
    Mode,
    Recompute,
    parse_bytes,
    plan_checkpointing,
)
from lightning_resume.errors import ConfigurationError

BlockClass = Union[str, type[nn.Module]]
Blocks = Union[BlockClass, Sequence[BlockClass], None]


def resolve_class_paths(blocks: Blocks) -> tuple[str, ...]:
    """Classes or ``"package.module.Class"`` strings -> canonical class paths (imported to check)."""
    items = [] if blocks is None else [blocks] if isinstance(blocks, (str, type)) else list(blocks)
    paths, problems = [], []
    for item in items:
        cls = _import_class(item) if isinstance(item, str) else item
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            paths.append(f"{cls.__module__}.{cls.__qualname__}")
        else:
            problems.append(f"blocks={item!r} is not an nn.Module class or an importable 'package.module.Class' path")
    if problems:
        raise ConfigurationError(OWNER, problems)
    return tuple(paths)


def _import_class(path: str) -> Optional[type]:
    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr) if module_name else None
    except (ImportError, AttributeError):
        return None


class _ActivationCheckpointingHook(ModelSetupHook):
    """Shared by the strategy classes below: plan on the bare model, then apply (or delegate).

    ``prepare_model`` runs inside the strategy's model setup: after ``configure_model``, before any wrapper.
    """

    activation_selection: BlockSelection
    activation_plan: Optional[CheckpointPlan]
    log_plan: bool

    def _init_activation(
        self,
        blocks: Blocks,
        pattern: Optional[str],
        select: Mode,
        every: Optional[int],
        budget: Union[int, str, None],
        log_plan: bool,
        recompute: Recompute = "full",
        save_ops: Optional[Sequence[str]] = None,
    ) -> None:
        check_versions()
        if save_ops is not None and recompute != "selective":
            raise ConfigurationError(
                OWNER, [f"save_ops is only used with recompute='selective' (got recompute={recompute!r})"]
            )
        self.activation_selection = BlockSelection(
            resolve_class_paths(blocks),
            pattern,
            select,
            every,
            parse_bytes(budget, "budget"),
            recompute,
            DEFAULT_SAVE_OPS if save_ops is None else tuple(save_ops),
        )
        if self.activation_selection.selective:
            resolve_save_ops(self.activation_selection.save_ops)  # unknown or random ops: refused now
        self.activation_plan = None
        self.log_plan = log_plan

    def _plan_activation(self, model: nn.Module) -> CheckpointPlan:
        remove_activation_checkpointing(model)  # a second fit/validate on the same module re-plans
        measured = self._measure(model)
        costs = self._measure_recompute(model) if measured is not None else None
        plan = plan_checkpointing(
            block_records(model, measured, costs), self.activation_selection, measured.total if measured else None
        )
        plan = self.broadcast(plan)  # every rank planned alike; rank 0 decides
        if self.log_plan:
            rank_zero_info(plan.describe())
        self.activation_plan = plan
        return plan

    def _measure(self, model: nn.Module) -> Optional[SavedBytes]:
        """Saved bytes per candidate on ``example_input_array``; ``None`` when there is none."""
        example = getattr(model, "example_input_array", None)
        if example is None:
            if self.activation_selection.needs_measurement:
                raise ConfigurationError(
                    OWNER,
                    [
                        "select='budget' measures one forward pass on the LightningModule's `example_input_array`,"
                        " which is not set: set `model.example_input_array = <one batch input>` before fit"
                    ],
                )
            return None
        blocks = [r.name for r in block_records(model) if r.name]
        return _without_side_effects(
            model,
            self.root_device,
            lambda: measure_saved_bytes(model, lambda: _call_forward(model, self, example), blocks),
        )

    def _measure_recompute(self, model: nn.Module) -> Optional[RecomputeCosts]:
        """Op times and selectively kept bytes per block (``recompute='selective'`` only)."""
        if not self.activation_selection.selective:
            return None
        save = resolve_save_ops(self.activation_selection.save_ops)
        blocks = [r.name for r in block_records(model) if r.name]
        example = model.example_input_array  # set: _measure returned a measurement
        return _without_side_effects(
            model,
            self.root_device,
            lambda: measure_recompute(
                model,
                lambda: _call_forward(model, self, example),
                blocks,
                lambda op, args, kwargs: keeps_output(save, op, args, kwargs),
            ),
        )

    @override
    def prepare_model(self, model: nn.Module) -> None:
        apply_plan(model, self._plan_activation(model), log=rank_zero_info)


def _call_forward(model: nn.Module, strategy: Strategy, example: Any) -> Any:
    example = move_data_to_device(example, strategy.root_device)
    with strategy.precision_plugin.forward_context():
        if isinstance(example, (list, tuple)):
            return model(*example)
        return model(**example) if isinstance(example, dict) else model(example)


def _without_side_effects(model: nn.Module, device: torch.device, fn: Any) -> Any:
    """Run ``fn`` in train mode, leaving RNG streams, buffers (BatchNorm stats) and modes as found."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    modes = {m: m.training for m in model.modules()}
    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            model.train()
            return fn()
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        for m, training in modes.items():
            m.training = training


class ActivationCheckpointingStrategy(_ActivationCheckpointingHook, SingleDeviceStrategy):
    """Single-device training with the chosen blocks recomputed in backward.

    Args:
        blocks: block class(es), as classes or ``"package.module.Class"`` paths (subclasses match).
        pattern: glob over qualified names inside the LightningModule, e.g. ``"model.layers.*"``.
        select: ``"all"`` matching blocks, ``"every"`` k-th, ``"sqrt"`` segments, or ``"budget"``.
        every: k for ``select="every"`` (blocks 0, k, 2k, ...).
        budget: for ``select="budget"``: saved-activation bytes to fit (int or ``"512MiB"``);
            measured on the LightningModule's ``example_input_array``.
        log_plan: log the plan (units, estimated bytes saved, extra forward cost, and a per-block
            table of expected kept bytes and recompute time when measured) on rank 0.
        recompute: ``"full"`` reruns a chosen block whole; ``"selective"`` keeps the outputs of
            ``save_ops`` and reruns the rest. With ``select="budget"``, ``"selective"`` lets the
            planner choose per block between none, selective and full, from op times measured on
            ``example_input_array``.
        save_ops: ops whose outputs selective recomputation keeps, as ``"aten.mm"`` (every
            overload) or ``"aten.mm.default"``; default :data:`DEFAULT_SAVE_OPS` (matmuls,
            convolutions, fused attention).
        device: the device; by default the one the Trainer's ``accelerator``/``devices`` select.
    """

    strategy_name = "activation_checkpointing_single_device"

    def __init__(
        self,
        blocks: Blocks = None,
        pattern: Optional[str] = None,
        select: Mode = "all",
        every: Optional[int] = None,
        budget: Union[int, str, None] = None,
        log_plan: bool = True,
        recompute: Recompute = "full",
        save_ops: Optional[Sequence[str]] = None,
        device: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(device=device or "cpu", **kwargs)
        self._init_activation(blocks, pattern, select, every, budget, log_plan, recompute, save_ops)
        self._device_given = device is not None
        # Lightning's accelerator connector fills `parallel_devices` on any strategy that has the
        # attribute (accelerator_connector.py:521-524): that is how we learn the Trainer's device.
        self.parallel_devices: Optional[list[torch.device]] = None

    @property
    @override
    def root_device(self) -> torch.device:
        if self._device_given or not self.parallel_devices:
            return super().root_device
        if len(self.parallel_devices) > 1:
            raise ConfigurationError(
                OWNER,
                [
                    f"{type(self).__name__} runs on one device but the Trainer selects {len(self.parallel_devices)};"
                    " use ActivationCheckpointingDDPStrategy"
                ],
            )
        return torch.device(self.parallel_devices[0])


class ActivationCheckpointingDDPStrategy(_ActivationCheckpointingHook, DDPStrategy):
    """``DDPStrategy`` (every argument of it accepted) with the chosen blocks recomputed in backward.

    Arguments as :class:`ActivationCheckpointingStrategy`; ``**kwargs`` go to ``DDPStrategy``.
    """

    strategy_name = "activation_checkpointing_ddp"

    def __init__(
        self,
        blocks: Blocks = None,
        pattern: Optional[str] = None,
        select: Mode = "all",
        every: Optional[int] = None,
        budget: Union[int, str, None] = None,
        log_plan: bool = True,
        recompute: Recompute = "full",
        save_ops: Optional[Sequence[str]] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._init_activation(blocks, pattern, select, every, budget, log_plan, recompute, save_ops)


class ActivationCheckpointingFSDPStrategy(_ActivationCheckpointingHook, FSDPStrategy):
    """``FSDPStrategy`` whose native activation checkpointing recomputes the blocks this policy picks.

    Arguments as :class:`ActivationCheckpointingStrategy`; ``**kwargs`` go to ``FSDPStrategy``.
    ``select="sqrt"`` segments and ``recompute="selective"`` are refused: FSDP checkpoints whole modules only.
    """

    strategy_name = "activation_checkpointing_fsdp"

    def __init__(
        self,
        blocks: Blocks = None,
        pattern: Optional[str] = None,
        select: Mode = "all",
        every: Optional[int] = None,
        budget: Union[int, str, None] = None,
        log_plan: bool = True,
        recompute: Recompute = "full",
        **kwargs: Any,
    ) -> None:
        if recompute != "full":
            raise ConfigurationError(
                OWNER,
                [f"recompute={recompute!r} cannot be delegated to FSDP (it recomputes whole modules); use 'full'"],
            )
        clash = [k for k in ("activation_checkpointing", "activation_checkpointing_policy") if kwargs.get(k)]
        if clash:
            raise ConfigurationError(OWNER, [f"{clash[0]} is set by this strategy's blocks/pattern/select; remove it"])
        if select == "sqrt":
            raise ConfigurationError(
                OWNER, ["select='sqrt' segments cannot be delegated to FSDP; use 'all', 'every' or 'budget'"]
            )
        super().__init__(**kwargs)
        self._init_activation(blocks, pattern, select, every, budget, log_plan)

    @override
    def prepare_model(self, model: nn.Module) -> None:
        """Delegate to FSDP's native activation checkpointing: it wraps the chosen blocks while sharding."""
        chosen = set(self._plan_activation(model).blocks)
        ids = frozenset(id(m) for name, m in model.named_modules() if name in chosen)
        set_fsdp_checkpoint_fn(self, lambda module: id(module) in ids)
