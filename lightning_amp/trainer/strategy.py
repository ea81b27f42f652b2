"""TensorParallelStrategy ("tp_fused"): Megatron-style tensor parallelism for an unmodified LightningModule.

One process per device like "ddp" (gloo on CPU, nccl on CUDA). Ranks form TP groups of
``tensor_parallel_size`` consecutive ranks within a node and DP groups across them. At setup the
strategy (1) broadcasts rank 0's weights, (2) converts the module in place with
:func:`~lightning_amp.parallel.convert.convert` (this rank's slice of the existing weights),
(3) lets the precision plugin cast it, (4) gives every param an fp32 ``main_grad`` in one flat
buffer (:class:`~lightning_amp.parallel.main_grad.MainGradBuffer`) whose DP all-reduce replaces
torch's DDP wrapper. Before the optimizer step ``p.grad`` points at ``main_grad``; after it the
buffer is zeroed. Checkpoints hold the gathered full weights in the original key layout.
The machinery is :class:`~lightning_amp.parallel.runtime.TensorParallelRuntime` behind
:class:`~lightning_amp.strategy_base.TensorParallelStrategyMixin`, shared with the Fabric
strategy (:mod:`lightning_amp.fabric.strategy`); this file maps the Trainer's hooks onto it
(``lightning_amp.parallel`` imports no Lightning).
"""
from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Generator, Literal, Mapping, Optional, Sequence, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _destroy_dist_connection
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer

from lightning_amp._keywords import checks_keywords
from lightning_amp.parallel.config import TensorParallelConfig
from lightning_amp.strategy_base import PlanOption, SizeOption, TensorParallelStrategyMixin, destroy_group_at_exit  # noqa: F401
from lightning_amp.strategy_base import conversion_report as _conversion_report  # noqa: F401 (old name)
from lightning_amp.trainer.precision import AmpPrecision
from lightning_amp.unsupported import refuse_precision_under_tp_fused

_USE = ("precision='32-true', '16-mixed', 'bf16-mixed', '16-true', 'bf16-true' or a lightning-amp plugin "
        "(e.g. `plugins=[AmpO2Precision()]`)")


@checks_keywords
class TensorParallelStrategy(TensorParallelStrategyMixin, DDPStrategy):
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
        plan: ``"auto"``, or an explicit plan: a :class:`~lightning_amp.parallel.plan.TensorParallelPlan` (as
            ``strategy.plan`` holds after setup), its dict or JSON form, torch's plan dicts (``ColwiseParallel()``,
            ``RowwiseParallel()``, ``SequenceParallel()``), or ``"column" | "row" | "replicate"`` per module path
            or glob (docs/tensor-parallel.md, "The plan is a value").
        process_group_backend: as for "ddp" (default gloo on CPU, nccl on CUDA).
        bucket_numel: DP all-reduce bucket size in fp32 elements.
        overlap_grad_reduce: launch each DP bucket's all-reduce during backward when it is complete.
        allow_replicated: when the plan finds nothing to split at ``tensor_parallel_size > 1``, train the
            whole model replicated on every TP rank instead of raising ValueError at setup.
        unsplit_ok: module path globs (``["transformer.h.*.self_attention"]``) of attentions that ``plan="auto"``
            may leave whole on every rank; any other attention it cannot split raises ValueError at setup.
        config: a :class:`~lightning_amp.parallel.TensorParallelConfig` holding all of the options above
            but ``process_group_backend`` (then pass none of them as keywords).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin, timeout, start_method:
            as for :class:`DDPStrategy` (e.g. ``start_method="spawn"``). Its other keywords configure torch's
            ``DistributedDataParallel`` wrapper (comm hooks, ``find_unused_parameters``, ...), which tp_fused has
            not: they raise TypeError. Every keyword is named in the signature, so ``LightningCLI`` (jsonargparse)
            reads the options from it (docs/tensor-parallel.md, "In a LightningCLI config").

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
        precision_plugin: Optional[Precision] = None,
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
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        """Refuse plugins that cannot run on converted layers with an fp32 ``main_grad`` (at ``Trainer(...)``)."""
        refuse_precision_under_tp_fused(precision_plugin, Precision, (MixedPrecision, HalfPrecision, AmpPrecision), _USE)
        self._precision_plugin = precision_plugin

    # ------------------------------------------------------------------ launch and groups (sizes: the mixin)
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if isinstance(self._launcher, _MultiProcessingLauncher):
            self._launcher = _GatheringMultiProcessingLauncher(self, start_method=self._start_method)

    def setup_distributed(self) -> None:
        self._before_process_group()
        super().setup_distributed()
        self._after_process_group()

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: "Any") -> None:
        """Broadcast, plan, the precision plugin's cast, (fitting) the optimizers, ``main_grad``: see
        :meth:`~lightning_amp.strategy_base.TensorParallelStrategyMixin._setup_tensor_parallel`."""
        assert self.accelerator is not None and self.model is not None
        self._refuse_already_parallel(self.model)
        self.accelerator.setup(trainer)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._setup_tensor_parallel(self.model, self._precision_prepare, lambda _: self.model_to_device(),
                                    before_main_grad=lambda: self._setup_optimizers_and_precision(trainer, fitting),
                                    main_grad=fitting)
        if fitting:
            self._install_gradient_clipping()

    def _precision_prepare(self, _module: Any) -> None:
        """Step 3 of the setup: the precision plugin casts the converted module."""
        self.precision_plugin.convert_module(self.model)

    def _setup_optimizers_and_precision(self, trainer: "Any", fitting: bool) -> None:
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            from lightning.fabric.utilities.optimizer import _optimizers_to_device

            _optimizers_to_device(self.optimizers, self.root_device)

    def _install_gradient_clipping(self) -> None:
        """Norm clipping must see the whole model's norm (shards summed over TP). Lightning's Trainer has the
        precision plugin clip and gives a strategy no hook there, so for this run the plugin's
        ``clip_grad_by_norm`` is :meth:`clip_grad_by_norm` (an instance attribute, removed at teardown)."""
        self.precision_plugin.clip_grad_by_norm = self.clip_grad_by_norm

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        """Clip ``optimizer``'s (unscaled) grads to ``clip_val`` by the norm of the whole (unsharded) model."""
        self.runtime.clip_grad_norm([p for group in optimizer.param_groups for p in group["params"]], clip_val)

    def teardown(self) -> None:
        """The precision plugin handed back as it came (its own clipping), then the mixin's teardown."""
        if self._precision_plugin is not None:
            vars(self._precision_plugin).pop("clip_grad_by_norm", None)
        super().teardown()

    # ------------------------------------------------------------------ backward and step
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """As Lightning's, with the gradient reduction between the backward and the precision plugin's
        ``post_backward`` (``p.grad`` is the exposed fp32 ``main_grad`` by then)."""
        module = self.lightning_module
        self.pre_backward(closure_loss)
        self.runtime.before_backward()  # before the loss scale re-bases the grads held
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        self.runtime.finish_backward()
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
        with self.runtime.no_sync():
            yield None

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Full fp32 weights under the original module's keys (collective; every rank gets them)."""
        assert self.lightning_module is not None
        return self.runtime.full_state_dict(self.lightning_module)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        self.runtime.load_full_state_dict(self.lightning_module, checkpoint["state_dict"], strict=strict)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer state with every sharded param's per-element state gathered to full size
        (collective), so the checkpoint resumes at any TP size."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return self.runtime.gather_optimizer_state(optimizer, optimizer.state_dict())

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Take this rank's slice of every full-size per-element state saved by :meth:`optimizer_state`."""
        from lightning.fabric.utilities.optimizer import _optimizer_to_device

        for optimizer, opt_state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer = getattr(optimizer, "_optimizer", optimizer)
            optimizer.load_state_dict(self.runtime.shard_optimizer_state(optimizer, opt_state))
            _optimizer_to_device(optimizer, self.root_device)

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
        """Lightning's, whose ``lightning_module.state_dict()`` call (on every rank) returns the gathered weights."""
        with self._strategy.runtime.full_state_dict_on_call(trainer.lightning_module):
            return super()._collect_rank_zero_results(trainer, results)


TensorParallelStrategy.register_strategies(StrategyRegistry)
