"""TensorParallelStrategy for Lightning Fabric: ``Fabric(strategy="tp_fused", devices=N)``.

The Trainer strategy of the same name (:class:`lightning_amp.TensorParallelStrategy`) in a
hand-written Fabric loop; both are :class:`~lightning_amp.strategy_base.TensorParallelStrategyMixin`
(options, sizes, groups, the one model setup, the step's bookkeeping), this file maps Fabric's hooks onto it.
One process per device as ``"ddp"`` (gloo on CPU, nccl on CUDA); TP groups of
``tensor_parallel_size`` consecutive ranks inside a node, DP across them.

* ``fabric.setup(model, optimizer)``: rank 0's weights are broadcast, the plan converts the model in
  place (this rank's slice of the existing weights), then the precision plugin casts it (a
  lightning-amp plugin converts *after* the plan, so its O2 half copies are those of the shards), and
  every param gets an fp32 ``main_grad`` in one flat buffer reduced over DP (no DDP wrapper). The
  optimizer built over the unconverted ``model.parameters()`` is rebound to the shards, param for
  param by name; a param the conversion split (``nn.MultiheadAttention``'s ``in_proj_weight`` becomes q/k/v
  projections, a fused qkv with replicated key/value heads a query shard and the key/value rows) is replaced
  by its parts in the same param group. One model per Fabric.
* ``fabric.backward``: backward, then (unless inside ``fabric.no_backward_sync``) the DP all-reduce of
  ``main_grad`` and ``p.grad = main_grad``; ``optimizer.step()`` then clears that optimizer's part of
  the buffer, and ``optimizer.zero_grad()`` (without a step) clears it at the next backward.
* ``fabric.clip_gradients(max_norm=...)`` clips to the norm of the whole model (shards summed over TP).
* ``fabric.save`` / ``fabric.load``: full fp32 weights under the original keys and full-size
  optimizer state (collective: every rank calls them, as Fabric requires), so a checkpoint moves
  between TP sizes and to or from a plain one-process run.
* ``setup_dataloaders`` splits the data over the DP ranks only (TP ranks see the same batches); a loop
  that splits batches by hand uses ``fabric.strategy.distributed_sampler_kwargs``.

Precisions: Fabric's ``32-true``, ``16-mixed``/``bf16-mixed``, ``16-true``/``bf16-true`` and
lightning-amp's :class:`~lightning_amp.fabric.FabricAmpPrecision` (O0-O3); any other plugin raises
TypeError when the Fabric is built.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, Dict, List, Literal, Mapping, Optional, Sequence, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_amp._keywords import checks_keywords
from lightning_amp.fabric.precision import FabricAmpPrecision
from lightning_amp.parallel.config import TensorParallelConfig
from lightning_amp.parallel.runtime import TensorParallelRuntime
from lightning_amp.strategy_base import PlanOption, SizeOption, TensorParallelStrategyMixin
from lightning_amp.unsupported import refuse_precision_under_tp_fused

_USE = ("Fabric's precision='32-true', '16-mixed', 'bf16-mixed', '16-true', 'bf16-true' or lightning_amp.fabric's "
        "FabricAmpPrecision (e.g. `plugins=[FabricAmpO2Precision()]`)")


@checks_keywords
class TensorParallelStrategy(TensorParallelStrategyMixin, DDPStrategy):
    """Tensor parallel x data parallel with fused fp32 weight-gradient accumulation, for Fabric.

    Same arguments as the Trainer's :class:`lightning_amp.TensorParallelStrategy` (``tensor_parallel_size``,
    ``sequence_parallel``, ``sequence_dim``, ``gradient_accumulation_fusion``, ``async_grad_allreduce``,
    ``plan``, ``process_group_backend``, ``bucket_numel``, ``overlap_grad_reduce``, ``allow_replicated``, ``unsplit_ok``, or
    ``config=TensorParallelConfig(...)`` instead of the options but ``process_group_backend``);
    ``accelerator``, ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``, ``precision``, ``timeout``,
    ``start_method`` as for Fabric's ``DDPStrategy``; its other keywords configure torch's ``DistributedDataParallel``
    wrapper, which tp_fused has not (TypeError). Registered as
    ``"tp_fused"`` (processes started by re-running the script) and ``"tp_fused_spawn"``.
    """

    def __init__(
        self,
        tensor_parallel_size: SizeOption = "auto",
        sequence_parallel: bool = False,
        gradient_accumulation_fusion: bool = True,
        async_grad_allreduce: bool = True,
        plan: PlanOption = "auto",
        process_group_backend: Optional[str] = None,
        sequence_dim: Optional[Literal[0, 1]] = None,
        bucket_numel: int = 2**22,
        overlap_grad_reduce: bool = True,
        allow_replicated: bool = False,
        unsplit_ok: Sequence[str] = (),
        config: Optional[TensorParallelConfig] = None,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
        timeout: Optional[timedelta] = timedelta(seconds=1800),
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        self._init_tensor_parallel(
            config, tensor_parallel_size=tensor_parallel_size, sequence_parallel=sequence_parallel,
            gradient_accumulation_fusion=gradient_accumulation_fusion, async_grad_allreduce=async_grad_allreduce, plan=plan,
            sequence_dim=sequence_dim, bucket_numel=bucket_numel, overlap_grad_reduce=overlap_grad_reduce,
            allow_replicated=allow_replicated, unsplit_ok=unsplit_ok,
        )
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision,
                         process_group_backend=process_group_backend, timeout=timeout, start_method=start_method)
        self._backward_sync_control = _MainGradSyncControl(self.runtime)
        self._module: Optional[nn.Module] = None
        self._optimizers: List[Optimizer] = []

    # ------------------------------------------------------------------ precision
    @property
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    def precision(self, precision: Optional[Precision]) -> None:
        """Refuse plugins that cannot run on converted layers with an fp32 ``main_grad`` (at ``Fabric(...)``)."""
        refuse_precision_under_tp_fused(precision, Precision, (MixedPrecision, HalfPrecision, FabricAmpPrecision), _USE)
        if isinstance(precision, FabricAmpPrecision):
            precision.prepared_by_strategy = True  # the model is prepared after the plan (setup_module)
        self._precision = precision

    # ------------------------------------------------------------------ groups (sizes, launcher: the mixin)
    def setup_environment(self) -> None:
        self._before_process_group()
        super().setup_environment()
        self._after_process_group()

    # ------------------------------------------------------------------ setup
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: List[Optimizer], scheduler: Optional[Any] = None):
        """Convert ``module`` (see :meth:`setup_module`) and rebind the optimizers to its shards."""
        before = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
        module = self.setup_module(module)
        for optimizer in optimizers:
            _rebind(optimizer, before, module)
        return module, [self.setup_optimizer(o) for o in optimizers], scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Broadcast rank 0's weights, apply the plan, cast (lightning-amp plugins), attach ``main_grad``."""
        if self._module is not None and self._module is not module:
            raise ValueError("strategy='tp_fused' sets up one model per Fabric (its main_grad buffer is reduced at every "
                             "fabric.backward); combine the models into one nn.Module, or use strategy='ddp' for several.")
        self._refuse_already_parallel(module)
        self._setup_tensor_parallel(module, self._precision_prepare, self.module_to_device)
        self._module = module
        return module

    def _precision_prepare(self, module: nn.Module) -> None:
        """Step 3 of the setup: a lightning-amp plugin casts the converted module (Fabric's own plugins need no cast)."""
        if isinstance(self.precision, FabricAmpPrecision):
            self.precision.prepare(module)

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if optimizer not in self._optimizers:
            self._optimizers.append(optimizer)
        return optimizer

    # ------------------------------------------------------------------ the step
    def backward(self, tensor: Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        """Backward, then (outside ``no_backward_sync``) the DP reduction and ``p.grad = main_grad``,
        before the precision plugin's ``post_backward``."""
        self.runtime.before_backward()  # before the loss scale re-bases the grads held
        self.precision.pre_backward(tensor, module)
        self.precision.backward(tensor, module, *args, **kwargs)
        self.runtime.finish_backward()
        self.precision.post_backward(tensor, module)

    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        """Unscale, then clip to the norm of the whole (unsharded) model; returns that norm."""
        self.precision.unscale_gradients(optimizer)
        norm = self.runtime.clip_grad_norm(list(self.precision.main_params(optimizer)), max_norm, norm_type)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, "
                               "so it cannot be clipped. To disable this error, pass `error_if_nonfinite=False`.")
        return norm

    # ------------------------------------------------------------------ checkpoints
    def get_module_state_dict(self, module: nn.Module) -> Dict[str, Any]:
        """Full fp32 weights under the original module's keys (collective)."""
        return self.runtime.full_state_dict(module)

    def load_module_state_dict(self, module: nn.Module, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        self.runtime.load_full_state_dict(module, state_dict, strict=strict)

    def get_optimizer_state(self, optimizer: Optimizer) -> Dict[str, Any]:
        """The optimizer's state with per-element state of sharded params gathered to full size (collective)."""
        return self.runtime.gather_optimizer_state(optimizer, optimizer.state_dict())

    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """As Fabric's; optimizers take their slice of the full-size state they are given."""
        runtime = self.runtime
        handles = [o.register_load_state_dict_pre_hook(lambda opt, sd: runtime.shard_optimizer_state(opt, sd))
                   for o in self._optimizers]
        try:
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        finally:
            for handle in handles:
                handle.remove()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "tp_fused", cls, description="Tensor parallel + flat fp32 main_grad data parallel (lightning-amp)", override=True,
        )
        strategy_registry.register(
            "tp_fused_spawn", cls, description="tp_fused launched with torch.multiprocessing spawn",
            start_method="spawn", override=True,
        )


class _MainGradSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync``: backwards only accumulate into ``main_grad``."""

    def __init__(self, runtime: TensorParallelRuntime) -> None:
        self.runtime = runtime

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self.runtime.no_sync() if enabled else nullcontext()


def _rebind(optimizer: Optimizer, before: Dict[int, str], module: nn.Module) -> None:
    """Point ``optimizer`` at the converted ``module``'s params, matched by name (``before``: id -> name); a param
    the conversion split (a fused qkv whose key/value rows are replicated, MHA's ``in_proj_weight``) is replaced
    by the params its converted layer names for it (``replacement_params``), in the same param group."""
    after = dict(module.named_parameters(remove_duplicate=False))
    current = {id(p) for p in after.values()}
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            name = before.get(id(p))
            if id(p) in current or name is None:  # unchanged, or not the model's
                params.append(p)
                continue
            if optimizer.state.get(p):
                raise ValueError(f"strategy='tp_fused': the optimizer has state for {name!r} already; call fabric.setup "
                                 "before the first optimizer.step() (load a checkpoint with fabric.load after setup).")
            params.extend([after[name]] if name in after else _replacements(module, name))
        group["params"] = params


def _replacements(module: nn.Module, name: str) -> List[nn.Parameter]:
    """The params of the converted layer that took over the original param ``name``."""
    owner, _, key = name.rpartition(".")
    try:
        return module.get_submodule(owner).replacement_params(key)
    except (AttributeError, KeyError):
        raise ValueError(
            f"strategy='tp_fused': the optimizer holds {name!r}, which the tensor-parallel conversion replaced by params "
            "it cannot map back to it; build the optimizer after the conversion: "
            "`model = fabric.setup_module(model)`, then `optimizer = fabric.setup_optimizers(make(model.parameters()))`."
        ) from None


TensorParallelStrategy.register_strategies(STRATEGY_REGISTRY)
