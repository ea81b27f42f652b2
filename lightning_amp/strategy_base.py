"""TensorParallelStrategyMixin: what the Trainer's and Fabric's ``"tp_fused"`` strategies share.

Lightning has two ``DDPStrategy`` classes (``lightning.pytorch`` for the Trainer, ``lightning.fabric`` for
Fabric) with different hooks, but both expose ``num_nodes``, ``num_processes``, ``global_rank``,
``root_device``, ``_configure_launcher``, ``optimizer_step`` and ``teardown``. This mixin implements the
tensor-parallel side once on those names; each strategy file only maps its framework's hooks onto it.
Use it first in the bases: ``class TensorParallelStrategy(TensorParallelStrategyMixin, DDPStrategy)``.

Each strategy's setup first refuses a model that is tensor-parallel already
(:meth:`TensorParallelStrategyMixin._refuse_already_parallel`: DTensor params, torch's TP hooks), before anything
changes. Contract of :meth:`TensorParallelStrategyMixin._setup_tensor_parallel`, the one setup of a model (top to
bottom): (1) rank 0's weights broadcast, (2) the plan applied in place (this rank's slices), then the RNG
agreed within the TP group, (3) the precision plugin's cast and the move to the device, (4) the fp32
``main_grad`` buffer attached. Steps 1-2 are skipped for a model converted already (an earlier ``fit``). The plan
report is logged on rank 0 after step 2 and kept as :attr:`TensorParallelStrategyMixin.plan_report`.
"""
from __future__ import annotations

from typing import Any, Callable, Literal, Mapping, Optional, Union

from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_amp.group_exit import destroy_group_at_exit
from lightning_amp.parallel.already_parallel import refuse_already_parallel
from lightning_amp.parallel.config import TensorParallelConfig
from lightning_amp.parallel.convert import PlanReport
from lightning_amp.parallel.plan import STYLES, TensorParallelPlan
from lightning_amp.parallel.runtime import TensorParallelRuntime

# The strategies' annotations of the options, as LightningCLI (jsonargparse) reads them from the signature: a YAML
# config's plan is a mapping {module path or glob: a style name, torch's style as ``class_path:
# torch.distributed.tensor.parallel.ColwiseParallel``, or a dict (a Style's dict form or a per-block plan)}, or
# ``"auto"``, or a plan's JSON text; the values are then checked by TensorParallelConfig (TensorParallelPlan.parse).
PlanOption = Union[Literal["auto"], Mapping[str, Union[Literal[STYLES], ParallelStyle, Mapping[str, Any]]], str]  # type: ignore[misc]
SizeOption = Union[int, Literal["auto"]]


class TensorParallelStrategyMixin:
    """The tensor-parallel state (:attr:`runtime`) and behaviour of a tp_fused strategy (see the module docstring)."""

    runtime: TensorParallelRuntime

    def _init_tensor_parallel(self, config: Optional[TensorParallelConfig], **options: Any) -> None:
        """Validate the options once: ``config``, or one built from the strategy's keywords ``options``."""
        self.runtime = TensorParallelRuntime(TensorParallelConfig.from_kwargs(config, **options))

    # ------------------------------------------------------------------ options and sizes
    @property
    def config(self) -> TensorParallelConfig:
        """The validated, frozen tensor-parallel options."""
        return self.runtime.config

    @property
    def plan(self) -> Optional[TensorParallelPlan]:
        """The checked plan (:class:`~lightning_amp.parallel.plan.TensorParallelPlan`: ``{module path: style}``) the
        model was split by: set at setup, None before. Print it, edit it, pass it back as ``plan=`` (also as
        ``plan.to_dict()`` or ``plan.to_json()``)."""
        return self.runtime.plan

    @property
    def plan_report(self) -> Optional[PlanReport]:
        """What the plan split (and how each unit was found) and what it left whole, and why: set at setup (printed
        there on rank 0), None before."""
        return self.runtime.report

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks per TP group (consecutive ranks of one node)."""
        return self.runtime.tensor_parallel_size(self.num_processes)

    @property
    def data_parallel_size(self) -> int:
        """Number of TP groups: world size / TP size."""
        return (self.num_nodes * self.num_processes) // self.tensor_parallel_size

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The data split over the DP ranks only (the ranks of a TP group see the same batches)."""
        return self.runtime.sampler_kwargs(self.num_nodes, self.num_processes, self.global_rank)

    # ------------------------------------------------------------------ launch and process groups
    def _configure_launcher(self) -> None:
        self.runtime.prepare_launch(self.num_nodes, self.num_processes, self.root_device.type)
        super()._configure_launcher()

    def _before_process_group(self) -> None:
        """ValueError, before any process group exists, unless the TP size divides the devices per node."""
        self.runtime.validate_sizes(self.num_nodes, self.num_processes)

    def _after_process_group(self) -> None:
        """Destroy every group at exit (all backends) and build the TP and DP groups."""
        destroy_group_at_exit()
        self.runtime.build_groups(self.num_processes)

    # ------------------------------------------------------------------ the model
    def _refuse_already_parallel(self, module: nn.Module) -> None:
        """ValueError, before anything is changed, for a model tensor-parallel already (DTensor params from a
        ``parallelize_module``, or its hooks); a model this strategy converted (an earlier ``fit``) passes."""
        if not self.runtime.converted:
            refuse_already_parallel(module)

    def _setup_tensor_parallel(
        self,
        module: nn.Module,
        cast: Callable[[nn.Module], Any],
        to_device: Callable[[nn.Module], Any],
        before_main_grad: Optional[Callable[[], Any]] = None,
        main_grad: bool = True,
    ) -> nn.Module:
        """Set ``module`` up for tensor parallelism in place, top to bottom (see the module docstring).

        ``cast``: the precision plugin's conversion of the (converted) module; ``to_device``: moves it to
        ``root_device``; ``before_main_grad``: what the framework does between the cast and the buffer (the
        Trainer builds the optimizers there); ``main_grad=False`` leaves the buffer out (not training).
        """
        runtime = self.runtime
        if runtime.needs_conversion(module):
            runtime.broadcast_from_rank_zero(module)  # 1. every rank starts from the same full weights
            runtime.apply_plan(module)  # 2. this rank keeps its slices of them
            rank_zero_info(conversion_report(runtime, self.data_parallel_size))
        runtime.agree_rng_within_tp_group(self.root_device)
        cast(module)  # 3. precision prepare: after the plan, so casts and O2 copies are those of the shards
        to_device(module)
        if before_main_grad is not None:
            before_main_grad()
        if main_grad:
            runtime.attach_grad_buffer(module.parameters())  # 4. fp32 main_grad, reduced over DP
        return module

    # ------------------------------------------------------------------ the step and the end
    def optimizer_step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """The framework's step, then ``main_grad`` and ``p.grad`` of ``optimizer``'s params are cleared
        (step taken or skipped)."""
        output = super().optimizer_step(optimizer, *args, **kwargs)
        self.runtime.after_step(optimizer)
        return output

    def teardown(self) -> None:
        """Wait for in-flight gradient all-reduces and detach the buffer's hooks. The TP/DP groups stay: the
        converted layers use them after ``fit`` (the spawn launcher gathers the weights after teardown, a
        later ``validate`` reuses them); every group is destroyed before the process exits (see
        :func:`destroy_group_at_exit`)."""
        self.runtime.release()
        super().teardown()


def conversion_report(runtime: TensorParallelRuntime, data_parallel_size: int) -> str:
    """The sizes and the plan report logged on rank 0 after the plan was applied."""
    return (f"tp_fused: tensor_parallel_size={runtime.groups.tp_size}, data_parallel_size={data_parallel_size}\n"
            + runtime.report.format())
