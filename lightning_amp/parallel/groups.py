"""Tensor-parallel (TP) and data-parallel (DP) process groups.

Ranks are laid out TP-major: the ``tp_size`` consecutive global ranks ``[k*tp, (k+1)*tp)``
form one TP group (so a TP group never crosses a node when ``tp_size`` divides the devices
per node), and ranks with equal TP rank form one DP group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist


def validate_sizes(world_size: int, tensor_parallel_size: int, devices_per_node: Optional[int] = None) -> None:
    """Raise ValueError unless ``tensor_parallel_size * dp == world_size`` for an integer dp >= 1.

    When ``devices_per_node`` is given, TP groups must also fit inside one node.
    """
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int or 'auto', got {tensor_parallel_size!r}")
    if world_size % tensor_parallel_size != 0:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} does not divide the world size {world_size}: "
            f"tensor_parallel_size x data_parallel_size must equal the number of processes ({world_size})"
        )
    if devices_per_node is not None and devices_per_node % tensor_parallel_size != 0:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} must divide the devices per node ({devices_per_node}) "
            "so that every TP group stays within one node"
        )


@dataclass
class ParallelGroups:
    """The groups one rank belongs to. ``tp_group``/``dp_group`` are None for a size-1 run without
    torch.distributed (every collective then becomes a no-op)."""

    tp_group: Any
    dp_group: Any
    tp_size: int
    tp_rank: int
    dp_size: int
    dp_rank: int

    @property
    def tp_src_global_rank(self) -> int:
        """The global rank of TP rank 0 of this rank's TP group."""
        return (dist.get_rank() // self.tp_size) * self.tp_size if dist.is_initialized() else 0


def single_process_groups() -> ParallelGroups:
    return ParallelGroups(None, None, 1, 0, 1, 0)


def build_groups(tensor_parallel_size: int) -> ParallelGroups:
    """Create the TP and DP groups over the initialised default group (every rank must call this)."""
    if not dist.is_initialized():
        validate_sizes(1, tensor_parallel_size)
        return single_process_groups()
    world, rank = dist.get_world_size(), dist.get_rank()
    validate_sizes(world, tensor_parallel_size)
    tp, dp = tensor_parallel_size, world // tensor_parallel_size
    my_tp = my_dp = None
    for k in range(dp):  # every rank must take part in creating every group
        group = dist.new_group(list(range(k * tp, (k + 1) * tp)))
        if rank // tp == k:
            my_tp = group
    for t in range(tp):
        group = dist.new_group(list(range(t, world, tp)))
        if rank % tp == t:
            my_dp = group
    return ParallelGroups(my_tp, my_dp, tp, rank % tp, dp, rank // tp)


def group_size(group: Any) -> int:
    """Size of ``group``; 1 when torch.distributed is not initialised."""
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Any) -> int:
    if not dist.is_initialized():
        return 0
    return dist.get_rank(group)
