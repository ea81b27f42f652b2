"""Tensor parallelism, framework-free: process groups, comm regions, parallel layers, the plan and its runtime.

The Lightning strategies that drive it are :mod:`lightning_amp.trainer.strategy` and :mod:`lightning_amp.fabric.strategy`.
"""
from lightning_amp.parallel.attention import ParallelMultiheadAttention
from lightning_amp.parallel.config import TensorParallelConfig
from lightning_amp.parallel.groups import ParallelGroups, build_groups
from lightning_amp.parallel.layers import ColumnParallelLinear, RowParallelLinear
from lightning_amp.parallel.main_grad import MainGradBuffer, clip_grad_norm_, tp_grad_norm
from lightning_amp.parallel.convert import apply_plan
from lightning_amp.parallel.plan import Style, TensorParallelPlan

__all__ = [
    "ColumnParallelLinear",
    "MainGradBuffer",
    "ParallelGroups",
    "ParallelMultiheadAttention",
    "RowParallelLinear",
    "Style",
    "TensorParallelConfig",
    "TensorParallelPlan",
    "apply_plan",
    "build_groups",
    "clip_grad_norm_",
    "tp_grad_norm",
]


def __getattr__(name):  # the Trainer's strategy, here until it moved to lightning_amp.trainer (lightning_amp._moved)
    if name == "TensorParallelStrategy":
        from lightning_amp._moved import alias

        return alias("lightning_amp.parallel.strategy").TensorParallelStrategy
    raise AttributeError(name)
