"""TensorParallelStrategy ("tp_fused"): Megatron-style tensor parallelism for an unmodified LightningModule.

One process per device like "ddp" (gloo on CPU, nccl on CUDA). Ranks form TP groups of
``tensor_parallel_size`` consecutive ranks within a node and DP groups across them. At setup the
strategy (1) broadcasts rank 0's weights, (2) converts the module in place with
:func:`~lightning_amp.parallel.plan.apply_plan` (this rank's slice of the existing weights),
(3) lets the precision plugin cast it, (4) gives every param an fp32 ``main_grad`` in one flat
buffer (:class:`~lightning_amp.parallel.main_grad.MainGradBuffer`) whose DP all-reduce replaces
torch's DDP wrapper. Before the optimizer step ``p.grad`` points at ``main_grad``; after it the
buffer is zeroed. Checkpoints hold the gathered full weights in the original key layout.
This is the only file of ``lightning_amp.parallel`` that imports Lightning.
"""
from __future__ import annotations

import atexit
import os
from contextlib import contextmanager
from typing import Any, Callable, Generator, Mapping, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _destroy_dist_connection
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer

from lightning_amp.parallel.groups import ParallelGroups, build_groups, validate_sizes
from lightning_amp.parallel.main_grad import MainGradBuffer, clip_grad_norm_
from lightning_amp.parallel.sequence import validate_sequence_dim
from lightning_amp.parallel.plan import apply_plan, format_table, gathered_state_dict, load_gathered_state_dict, validate_plan


class TensorParallelStrategy(DDPStrategy):
    """Tensor parallel x data parallel with fused fp32 weight-gradient accumulation.

    Args:
        tensor_parallel_size: ranks per TP group; ``"auto"`` = all devices of a node. Must divide
            the devices per node; ``tensor_parallel_size x dp = world size``.
        sequence_parallel: Megatron sequence parallelism inside the planned blocks (entries of an
            ``nn.ModuleList``/``nn.Sequential`` holding the converted layers): activations between
            the parallel layers are split along the sequence over TP, full again after the last
            block (see :mod:`~lightning_amp.parallel.sequence`). Models whose layers are not in such
            blocks raise ValueError at setup.
        sequence_dim: sequence dim of the blocks' hidden states, 0 (``[s, b, h]``) or 1 (``[b, s, h]``);
            ``None`` infers it from ``nn.TransformerEncoderLayer``/``DecoderLayer.batch_first`` (other
            blocks then raise ValueError asking for it).
        gradient_accumulation_fusion: parallel Linear weight grads go straight into ``main_grad``.
        async_grad_allreduce: overlap the input-gradient all-reduce with the weight-gradient GEMM.
        plan: ``"auto"`` or ``{"glob.of.module.names": "column" | "row" | "replicate"}``.
        process_group_backend: as for "ddp" (default gloo on CPU, nccl on CUDA).
        bucket_numel: DP all-reduce bucket size in fp32 elements.
        overlap_grad_reduce: launch each DP bucket's all-reduce during backward when it is complete.
        allow_replicated: when the plan finds nothing to split at ``tensor_parallel_size > 1``, train the
            whole model replicated on every TP rank instead of raising ValueError at setup.
        **ddp_kwargs: passed to :class:`DDPStrategy` (e.g. ``start_method="spawn"``, ``timeout``).

    On CUDA the launcher sets ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (inherited by every rank) so that the
    asynchronous input-gradient all-reduce is queued before the weight-gradient GEMM and overlaps it.
    The training sampler is distributed over the DP ranks only (TP ranks see the same batches).
    Loading a checkpoint: weights and optimizer state are resharded to the current TP size. Under
    O2 the params are fp32 (forward sees half copies), so the checkpoint holds their gathered fp32
    values and a resumed run is bitwise the uninterrupted one.
    """

    strategy_name = "tp_fused"

    def __init__(
        self,
        tensor_parallel_size: Union[int, str] = "auto",
        sequence_parallel: bool = False,
        gradient_accumulation_fusion: bool = True,
        async_grad_allreduce: bool = True,
        plan: Union[str, Mapping[str, str]] = "auto",
        process_group_backend: Optional[str] = None,
        sequence_dim: Optional[int] = None,
        bucket_numel: int = 2**22,
        overlap_grad_reduce: bool = True,
        allow_replicated: bool = False,
        **ddp_kwargs: Any,
    ) -> None:
        if tensor_parallel_size != "auto" and (
            not isinstance(tensor_parallel_size, int) or isinstance(tensor_parallel_size, bool) or tensor_parallel_size < 1
        ):
            raise ValueError(f"tensor_parallel_size must be 'auto' or a positive int, got {tensor_parallel_size!r}")
        for name, value in (("sequence_parallel", sequence_parallel), ("gradient_accumulation_fusion", gradient_accumulation_fusion),
                            ("async_grad_allreduce", async_grad_allreduce), ("overlap_grad_reduce", overlap_grad_reduce),
                            ("allow_replicated", allow_replicated)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")
        validate_sequence_dim(sequence_dim)
        if not isinstance(bucket_numel, int) or bucket_numel < 1:
            raise ValueError(f"bucket_numel must be a positive int, got {bucket_numel!r}")
        validate_plan(plan)
        super().__init__(process_group_backend=process_group_backend, **ddp_kwargs)
        self._tp_size_arg = tensor_parallel_size
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.async_grad_allreduce = async_grad_allreduce
        self.plan = plan
        self.bucket_numel = bucket_numel
        self.overlap_grad_reduce = overlap_grad_reduce
        self.allow_replicated = allow_replicated
        self.groups: Optional[ParallelGroups] = None
        self.grad_buffer: Optional[MainGradBuffer] = None
        self.conversions: list = []
        self._converted = False

    # ------------------------------------------------------------------ sizes and groups
    @property
    def tensor_parallel_size(self) -> int:
        if self._tp_size_arg == "auto":
            return max(self.num_processes, 1)
        return int(self._tp_size_arg)

    @property
    def data_parallel_size(self) -> int:
        return (self.num_nodes * self.num_processes) // self.tensor_parallel_size

    def _validate_sizes(self) -> None:
        validate_sizes(self.num_nodes * self.num_processes, self.tensor_parallel_size, devices_per_node=self.num_processes)

    def _configure_launcher(self) -> None:
        self._validate_sizes()
        if self.root_device.type == "cuda":
            # the async dgrad all-reduce only overlaps the wgrad GEMM with one hardware queue
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        super()._configure_launcher()
        if isinstance(self._launcher, _MultiProcessingLauncher):
            self._launcher = _GatheringMultiProcessingLauncher(self, start_method=self._start_method)

    def setup_distributed(self) -> None:
        self._validate_sizes()
        super().setup_distributed()
        if dist.is_initialized() and dist.get_backend() != "nccl":  # Lightning registers this for nccl only
            atexit.unregister(_destroy_dist_connection)
            atexit.register(_destroy_dist_connection)
        if self.groups is None:  # converted layers keep using these groups in later fit/validate calls
            self.groups = build_groups(self.tensor_parallel_size)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        tp = self.tensor_parallel_size
        return {"num_replicas": self.data_parallel_size, "rank": self.global_rank // tp}

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: "Any") -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model_to_device()
        if not self._converted and _holds_parallel_layers(self.model):
            self._converted = True  # converted by an earlier fit/validate: its shards must not be overwritten
        if not self._converted:
            self._broadcast_module_from_rank_zero()
            self.conversions = apply_plan(
                self.model,
                self.groups.tp_group,
                self.plan,
                sequence_parallel=self.sequence_parallel,
                sequence_dim=self.sequence_dim,
                allow_replicated=self.allow_replicated,
                gradient_accumulation_fusion=self.gradient_accumulation_fusion,
                async_grad_allreduce=self.async_grad_allreduce,
            )
            self._converted = True
            rank_zero_info(
                f"tp_fused: tensor_parallel_size={self.tensor_parallel_size}, data_parallel_size={self.data_parallel_size}\n"
                + format_table(self.conversions)
            )
        self._agree_rng_within_tp_group()
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            from lightning.fabric.utilities.optimizer import _optimizers_to_device

            _optimizers_to_device(self.optimizers, self.root_device)
            self.grad_buffer = MainGradBuffer(
                self.model.parameters(), self.groups.dp_group, self.groups.tp_group,
                bucket_numel=self.bucket_numel, overlap=self.overlap_grad_reduce,
            )
            self._patch_gradient_clipping()

    def _broadcast_module_from_rank_zero(self) -> None:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        with torch.no_grad():
            for tensor in list(self.model.parameters()) + list(self.model.buffers()):
                dist.broadcast(tensor.data, src=0)

    def _agree_rng_within_tp_group(self) -> None:
        """TP ranks compute replicated regions redundantly: their dropout masks must agree."""
        if self.groups is None or self.groups.tp_size == 1:
            return
        src = self.groups.tp_src_global_rank
        state = torch.get_rng_state()
        dist.broadcast(state, src=src, group=self.groups.tp_group)
        torch.set_rng_state(state)
        if self.root_device.type == "cuda":
            cuda_state = torch.cuda.get_rng_state(self.root_device).to(self.root_device)
            dist.broadcast(cuda_state, src=src, group=self.groups.tp_group)
            torch.cuda.set_rng_state(cuda_state.cpu(), self.root_device)

    def _patch_gradient_clipping(self) -> None:
        """Norm-based clipping must see the full model's norm: sharded params summed over TP."""
        plugin = self.precision_plugin
        tp_group = self.groups.tp_group

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: Union[int, float]) -> None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            clip_grad_norm_(params, clip_val, tp_group)

        plugin.clip_grad_by_norm = clip_grad_by_norm

    # ------------------------------------------------------------------ backward and step
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """As Lightning's, with the gradient reduction between the backward and the precision plugin's
        ``post_backward`` (``p.grad`` is the exposed fp32 ``main_grad`` by then)."""
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        buffer = self.grad_buffer
        if buffer is not None and buffer.sync_enabled:
            buffer.finish_sync()
            buffer.expose_grads()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def pre_backward(self, closure_loss: Tensor) -> None:
        pass

    def post_backward(self, closure_loss: Tensor) -> None:
        pass

    @contextmanager
    def block_backward_sync(self) -> Generator:
        """Micro-batches before the last one only accumulate into ``main_grad`` (no reduction)."""
        if self.grad_buffer is None:
            yield None
            return
        self.grad_buffer.sync_enabled = False
        try:
            yield None
        finally:
            self.grad_buffer.sync_enabled = True

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.grad_buffer is not None:
            self.grad_buffer.zero()
        return output

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Full fp32 weights under the original module's keys (collective; every rank gets them)."""
        assert self.lightning_module is not None
        if not self._converted:
            return self.lightning_module.state_dict()
        state = gathered_state_dict(self.lightning_module)
        return {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in state.items()}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        if not self._converted:
            self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)
            return
        load_gathered_state_dict(self.lightning_module, checkpoint["state_dict"], strict=strict)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer state with every sharded param's per-element state gathered to full size
        (collective), so the checkpoint resumes at any TP size."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        state = optimizer.state_dict()
        if not self._converted or self.groups is None:
            return state
        params = [p for group in optimizer.param_groups for p in group["params"]]
        gathered = {}
        for index, per_param in state["state"].items():
            param = params[index]
            per_param = dict(per_param)
            layout = getattr(param, "shard_layout", None)
            if layout is not None:
                for key, value in per_param.items():
                    if torch.is_tensor(value) and value.shape == param.shape:
                        per_param[key] = layout.gather(value)
            gathered[index] = per_param
        return {**state, "state": gathered}

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Take this rank's slice of every full-size per-element state saved by :meth:`optimizer_state`."""
        from lightning.fabric.utilities.optimizer import _optimizer_to_device

        for optimizer, opt_state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer = getattr(optimizer, "_optimizer", optimizer)
            params = [p for group in optimizer.param_groups for p in group["params"]]
            sliced = {}
            for index, per_param in opt_state["state"].items():
                param = params[int(index)]
                per_param = dict(per_param)
                layout = getattr(param, "shard_layout", None)
                if layout is not None:
                    for key, value in per_param.items():
                        if torch.is_tensor(value) and value.dim() == param.dim():  # saved full, original layout
                            per_param[key] = layout.shard(value)
                sliced[index] = per_param
            optimizer.load_state_dict({**opt_state, "state": sliced})
            _optimizer_to_device(optimizer, self.root_device)

    def teardown(self) -> None:
        """Wait for in-flight gradient all-reduces and detach the buffer's hooks. The TP/DP groups stay: the
        converted layers use them after ``fit`` (the spawn launcher gathers the weights after teardown, a
        later ``validate`` reuses them); every group is destroyed before the process exits (see the launcher
        and the ``atexit`` handler registered in :meth:`setup_distributed`)."""
        if self.grad_buffer is not None:
            self.grad_buffer.remove_hooks()
            self.grad_buffer = None
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Tensor parallel + flat fp32 main_grad data parallel (lightning-amp)",
            override=True,
        )
        strategy_registry.register(
            "tp_fused_spawn", cls, description="tp_fused launched with torch.multiprocessing spawn",
            start_method="spawn", override=True,
        )


def _holds_parallel_layers(module: Any) -> bool:
    from lightning_amp.parallel.attention import ParallelMultiheadAttention
    from lightning_amp.parallel.layers import ColumnParallelLinear, RowParallelLinear

    return any(isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelMultiheadAttention)) for m in module.modules())


class _GatheringMultiProcessingLauncher(_MultiProcessingLauncher):
    """Spawn launcher that hands the main process the *gathered* weights (original layout), which load
    into the unconverted module there, and destroys the default process group before a worker exits.

    Lightning destroys it only for NCCL (an ``atexit`` handler); a gloo group left to interpreter
    finalization can abort the worker after training finished (SIGABRT, "terminate called without an
    active exception"), which the launcher reports as a failed run.
    """

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)  # fit, teardown, then the gather of the weights
        _destroy_dist_connection()  # every group; after a failure the process dies anyway, destroying could block

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        module = trainer.lightning_module
        original = module.state_dict
        strategy = self._strategy

        def gathered(*args: Any, **kwargs: Any) -> dict:
            module.state_dict = original
            try:
                return strategy.lightning_module_state_dict()  # collective on all ranks
            finally:
                module.state_dict = gathered

        module.state_dict = gathered
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            module.state_dict = original


TensorParallelStrategy.register_strategies(StrategyRegistry)
