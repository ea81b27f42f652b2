"""tp_fused applied to one model, without Lightning: what the Trainer and the Fabric strategies share.

:class:`TensorParallelRuntime` holds the options of ``strategy="tp_fused"`` (a frozen
:class:`~lightning_amp.parallel.config.TensorParallelConfig`, validated when it was built), the TP/DP process groups, the conversion of the model, its fp32 ``main_grad``
buffer and the checkpoint layout. A strategy calls, in order:

1. :meth:`~TensorParallelRuntime.validate_sizes` (launch) and :meth:`~TensorParallelRuntime.build_groups`
   (after ``torch.distributed`` is initialised);
2. :meth:`~TensorParallelRuntime.convert`: rank 0's weights broadcast, the plan applied in place
   (this rank's slice of the existing weights), the RNG agreed within the TP group;
3. :meth:`~TensorParallelRuntime.attach_grad_buffer` once the params have their final dtype;
4. per step: :meth:`~TensorParallelRuntime.before_backward`, backward,
   :meth:`~TensorParallelRuntime.finish_backward` (DP all-reduce, ``p.grad`` = ``main_grad``), each
   optimizer's step, :meth:`~TensorParallelRuntime.after_step` (that optimizer's part of the buffer cleared);
   :meth:`~TensorParallelRuntime.no_sync` around the backwards of micro-batches before the last.

Checkpoints hold the full tensors in the original module's layout (fp32 weights; optimizer states
gathered to full size), so they load at any TP size and into the unconverted model.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Generator, Iterable, Mapping, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_amp.parallel.config import TensorParallelConfig
from lightning_amp.parallel.groups import ParallelGroups, build_groups, validate_sizes
from lightning_amp.parallel.main_grad import MainGradBuffer, clip_grad_norm_
from lightning_amp.parallel.convert import (PARALLEL_LAYERS, Conversion, PlanReport, convert, gathered_state_dict,
                                            load_gathered_state_dict)
from lightning_amp.parallel.plan import TensorParallelPlan, check_plan
from lightning_amp.parallel.reading.model_reading import read_model


class TensorParallelRuntime:
    """The options and state of tp_fused for one model (see the module docstring and
    :class:`lightning_amp.TensorParallelStrategy` for the arguments)."""

    def __init__(self, config: Optional[TensorParallelConfig] = None, **options: Any) -> None:
        """``config``, or a :class:`TensorParallelConfig` built from ``options`` (its field names)."""
        self.config = TensorParallelConfig.from_kwargs(config, **options)
        self.groups: Optional[ParallelGroups] = None
        self.grad_buffer: Optional[MainGradBuffer] = None
        self.conversions: list[Conversion] = []
        self.plan: Optional[TensorParallelPlan] = None  # the checked plan (after apply_plan)
        self.report: Optional[PlanReport] = None  # what the plan split and left whole (after apply_plan)
        self.converted = False

    # ------------------------------------------------------------------ sizes and groups
    def tensor_parallel_size(self, devices_per_node: int) -> int:
        """The TP size; ``"auto"`` is every device of a node."""
        return self.config.tp_size(devices_per_node)

    def validate_sizes(self, num_nodes: int, devices_per_node: int) -> None:
        """ValueError unless TP divides the devices per node (and so the world size)."""
        validate_sizes(num_nodes * devices_per_node, self.tensor_parallel_size(devices_per_node), devices_per_node=devices_per_node)

    def prepare_launch(self, num_nodes: int, devices_per_node: int, device_type: str) -> None:
        """Validate the sizes; on CUDA set ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (inherited by every rank) so that
        the asynchronous input-gradient all-reduce is queued before the weight-gradient GEMM and overlaps it."""
        self.validate_sizes(num_nodes, devices_per_node)
        if device_type == "cuda":
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"

    def sampler_kwargs(self, num_nodes: int, devices_per_node: int, global_rank: int) -> dict[str, int]:
        """The data split over the DP ranks only (the ranks of a TP group see the same batches)."""
        tp = self.tensor_parallel_size(devices_per_node)
        return {"num_replicas": num_nodes * devices_per_node // tp, "rank": global_rank // tp}

    def build_groups(self, devices_per_node: int) -> ParallelGroups:
        """The TP and DP groups (collective over the default group; built once: converted layers keep them)."""
        if self.groups is None:
            self.groups = build_groups(self.tensor_parallel_size(devices_per_node))
        return self.groups

    # ------------------------------------------------------------------ the model
    def convert(self, module: nn.Module, device: torch.device) -> bool:
        """Steps 1-2 of the setup in one call (see :meth:`needs_conversion`, :meth:`broadcast_from_rank_zero`,
        :meth:`apply_plan`, :meth:`agree_rng_within_tp_group`); returns whether it converted now."""
        fresh = self.needs_conversion(module)
        if fresh:
            self.broadcast_from_rank_zero(module)
            self.apply_plan(module)
        else:
            self.adopt(module)
        self.agree_rng_within_tp_group(device)
        return fresh

    def needs_conversion(self, module: nn.Module) -> bool:
        """False once this runtime converted a module, or when ``module`` holds parallel layers already (an
        earlier fit: its shards must not be overwritten)."""
        return not self.converted and not holds_parallel_layers(module)

    def adopt(self, module: nn.Module) -> None:
        """Use ``module`` as converted already (checkpoints gather its shards)."""
        self.converted = True

    def broadcast_from_rank_zero(self, module: nn.Module) -> None:
        """Every rank takes rank 0's params and buffers (collective over the default group)."""
        _broadcast_from_rank_zero(module)

    def apply_plan(self, module: nn.Module) -> list[Conversion]:
        """Read ``module`` once (:func:`~lightning_amp.parallel.reading.model_reading.read_model`), check the plan on that
        reading (:func:`~lightning_amp.parallel.plan.check_plan`, kept as :attr:`plan`),
        then replace the planned layers in place by parallel ones holding this rank's slices of the existing weights
        (:func:`~lightning_amp.parallel.convert.convert`); returns the conversion table and keeps the whole
        :class:`~lightning_amp.parallel.convert.PlanReport` as :attr:`report`."""
        assert self.groups is not None, "build_groups first"
        config = self.config
        reading = read_model(module, self.groups.tp_size)
        self.plan = check_plan(reading, config.plan, config.sequence_parallel, config.allow_replicated, config.unsplit_ok,
                               config.sequence_dim)
        self.report = convert(module, self.plan, self.groups.tp_group, config)
        self.conversions = self.report.conversions
        self.converted = True
        return self.conversions

    def agree_rng_within_tp_group(self, device: torch.device) -> None:
        """TP ranks compute replicated regions redundantly: their dropout masks must agree (the CPU and,
        on CUDA, ``device``'s generator take the TP group's first rank's state)."""
        if self.groups is None or self.groups.tp_size == 1:
            return
        src = self.groups.tp_src_global_rank
        state = torch.get_rng_state()
        dist.broadcast(state, src=src, group=self.groups.tp_group)
        torch.set_rng_state(state)
        if device.type == "cuda":
            cuda_state = torch.cuda.get_rng_state(device).to(device)
            dist.broadcast(cuda_state, src=src, group=self.groups.tp_group)
            torch.cuda.set_rng_state(cuda_state.cpu(), device)

    def attach_grad_buffer(self, params: Iterable[nn.Parameter]) -> MainGradBuffer:
        """Give every trainable param an fp32 ``main_grad`` in one flat buffer reduced over DP."""
        assert self.groups is not None, "build_groups first"
        self.release()
        self.grad_buffer = MainGradBuffer(params, self.groups.dp_group, self.groups.tp_group,
                                          bucket_numel=self.config.bucket_numel, overlap=self.config.overlap_grad_reduce)
        return self.grad_buffer

    def release(self) -> None:
        """Wait for in-flight all-reduces and detach the buffer's hooks (the groups stay)."""
        if self.grad_buffer is not None:
            self.grad_buffer.remove_hooks()
            self.grad_buffer = None

    # ------------------------------------------------------------------ the step
    def before_backward(self) -> None:
        """Before each backward: ``main_grad`` takes what was done to the exposed ``p.grad`` since the last
        one (``optimizer.zero_grad()`` without a step clears it; see :meth:`MainGradBuffer.reclaim`)."""
        if self.grad_buffer is not None:
            self.grad_buffer.reclaim()

    def finish_backward(self) -> None:
        """After a synced backward: complete the reductions and point every ``p.grad`` at its ``main_grad``."""
        buffer = self.grad_buffer
        if buffer is not None and buffer.sync_enabled:
            buffer.finish_sync()
            buffer.expose_grads()

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Backwards inside only accumulate into ``main_grad`` (no reduction)."""
        if self.grad_buffer is None:
            yield None
            return
        self.grad_buffer.sync_enabled = False
        try:
            yield None
        finally:
            self.grad_buffer.sync_enabled = True

    def after_step(self, optimizer: Optional[Optimizer] = None) -> None:
        """Clear ``main_grad`` and ``p.grad`` of ``optimizer``'s params (all when None) after its step,
        taken or skipped: another optimizer's grads in the same buffer wait for its own step."""
        if self.grad_buffer is not None:
            self.grad_buffer.zero(None if optimizer is None else _params(optimizer))

    def clip_grad_norm(self, params: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip to the norm of the whole (unsharded) model; returns that norm before clipping."""
        return clip_grad_norm_(params, max_norm, self.groups.tp_group if self.groups else None, norm_type)

    # ------------------------------------------------------------------ checkpoints
    def full_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """Full fp32 weights under the original module's keys (collective; every rank gets them)."""
        if not self.converted:
            return module.state_dict()
        state = gathered_state_dict(module)
        return {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in state.items()}

    @contextmanager
    def full_state_dict_on_call(self, module: nn.Module) -> Generator[None, None, None]:
        """Inside, ``module.state_dict()`` returns :meth:`full_state_dict` (a collective: every rank must call it),
        for code that calls ``state_dict()`` itself (Lightning's spawn launcher after ``fit``). A state-dict
        post-hook, registered for the duration only, replaces the sharded entries; nested calls (the gather
        reads the sharded state first) are left alone."""
        busy = False

        def gather(mod: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
            nonlocal busy
            if busy or prefix:  # the gather's own state_dict() call, or module used as a submodule
                return
            busy = True
            try:
                full = self.full_state_dict(mod)
            finally:
                busy = False
            state.clear()
            state.update(full)

        handle = module.register_state_dict_post_hook(gather)
        try:
            yield
        finally:
            handle.remove()

    def load_full_state_dict(self, module: nn.Module, state: Mapping[str, Any], strict: bool = True) -> None:
        """Load a full (original-layout) state, each rank taking its slice."""
        if not self.converted:
            module.load_state_dict(state, strict=strict)
            return
        load_gathered_state_dict(module, state, strict=strict)

    def gather_optimizer_state(self, optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        """``optimizer``'s ``state`` (its ``state_dict()``) with every sharded param's per-element state
        gathered to full size in the original layout (collective)."""
        if not self.converted or self.groups is None:
            return state
        params = _params(optimizer)
        gathered = {}
        for index, per_param in state["state"].items():
            param, per_param = params[index], dict(per_param)
            layout = getattr(param, "shard_layout", None)
            if layout is not None:
                for key, value in per_param.items():
                    if torch.is_tensor(value) and value.shape == param.shape:
                        per_param[key] = layout.gather(value)
            gathered[index] = per_param
        return {**state, "state": gathered}

    def shard_optimizer_state(self, optimizer: Optimizer, state: Mapping[str, Any]) -> dict[str, Any]:
        """The inverse of :meth:`gather_optimizer_state`: this rank's slice of every full-size per-element state."""
        params = _params(optimizer)
        sliced = {}
        for index, per_param in state["state"].items():
            param, per_param = params[int(index)], dict(per_param)
            layout = getattr(param, "shard_layout", None)
            if layout is not None:
                for key, value in per_param.items():
                    if torch.is_tensor(value) and value.dim() == param.dim():  # saved full, original layout
                        per_param[key] = layout.shard(value)
            sliced[index] = per_param
        return {**state, "state": sliced}


def holds_parallel_layers(module: nn.Module) -> bool:
    """Whether ``module`` was converted already (holds a parallel layer)."""
    return any(isinstance(m, PARALLEL_LAYERS) for m in module.modules())


def _broadcast_from_rank_zero(module: nn.Module) -> None:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=0)


def _params(optimizer: Optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]
