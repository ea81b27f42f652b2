"""Tensor parallelism: process groups, comm regions, parallel layers, the plan and (with Lightning) the strategy."""
from lightning_amp.parallel.attention import ParallelMultiheadAttention
from lightning_amp.parallel.config import TensorParallelConfig
from lightning_amp.parallel.groups import ParallelGroups, build_groups
from lightning_amp.parallel.layers import ColumnParallelLinear, RowParallelLinear
from lightning_amp.parallel.main_grad import MainGradBuffer, clip_grad_norm_, tp_grad_norm
from lightning_amp.parallel.plan import apply_plan

__all__ = [
    "ColumnParallelLinear",
    "MainGradBuffer",
    "ParallelGroups",
    "ParallelMultiheadAttention",
    "RowParallelLinear",
    "TensorParallelConfig",
    "TensorParallelStrategy",
    "apply_plan",
    "build_groups",
    "clip_grad_norm_",
    "tp_grad_norm",
]


def __getattr__(name):  # the strategy needs Lightning: import it only when asked for
    if name == "TensorParallelStrategy":
        from lightning_amp.parallel.strategy import TensorParallelStrategy

        return TensorParallelStrategy
    raise AttributeError(name)
