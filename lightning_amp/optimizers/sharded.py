"""DTensor params (FSDP2, DTensor tensor parallelism) for optimizers that need norms of whole tensors
(FusedLAMB's trust ratio and global grad norm).

The elementwise updates need nothing from here: ``lightning_amp.ops`` hands DTensors to DTensor's
dispatch, which runs the kernels on the local shards. The trust ratio's norms are reduced by DTensor
too (``ops.multi_tensor_lamb``'s two passes; one call per placement class, :func:`placement_classes`).
The global grad norm sums over all params of all classes, which no single placement says: a norm of a
whole tensor is the square root of the sum, over the ranks holding its shards, of the squared norms of
the local shards; :func:`shard_sum_` all-reduces those squares over the mesh dimensions on which the
tensor is sharded (replicated dimensions hold copies and are not summed). One all-reduce per (mesh,
sharded dims) class and mesh dimension, on the device, no host read.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_amp.ops import _DTensor


def _sharded_dims(t: Tensor) -> Tuple[int, ...]:
    # Shard and _StridedShard (FSDP2 over a tensor-parallel dim; its is_shard() says False)
    return tuple(dim for dim, placement in enumerate(t.placements)
                 if not (placement.is_replicate() or placement.is_partial()))


def any_sharded(tensors: Sequence[Tensor]) -> bool:
    """Whether some tensor is a DTensor sharded on at least one mesh dimension."""
    return _DTensor is not None and any(isinstance(t, _DTensor) and _sharded_dims(t) for t in tensors)


def shard_sum_(tensors: Sequence[Tensor], squares: Tensor) -> Tensor:
    """``squares`` (one row per tensor: squared norms of its local shard) summed, row by row, over the
    ranks that hold the other shards of each sharded DTensor in ``tensors``; other rows unchanged.
    Every rank must call this with the same tensors (the all-reduces are collective). Returns ``squares``."""
    classes: Dict[tuple, List[int]] = {}
    for i, t in enumerate(tensors):
        if isinstance(t, _DTensor) and _sharded_dims(t):
            classes.setdefault((t.device_mesh, _sharded_dims(t)), []).append(i)
    for (mesh, dims), rows in classes.items():
        index = torch.tensor(rows, device=squares.device)
        part = squares.index_select(0, index)
        for dim in dims:
            if mesh.size(dim) > 1:
                dist.all_reduce(part, group=mesh.get_group(dim))
        squares.index_copy_(0, index, part)
    return squares


def placement_classes(tensors: Sequence[Tensor]) -> List[List[Tensor]]:
    """``tensors`` split by (mesh, placements), in order of first appearance; plain tensors form one class.
    A multi-tensor op whose outputs DTensor reduces takes one placement per mesh dimension for all its tensors."""
    classes: Dict[tuple, List[Tensor]] = {}
    for t in tensors:
        key = (t.device_mesh, tuple(t.placements)) if _DTensor is not None and isinstance(t, _DTensor) else None
        classes.setdefault(key, []).append(t)
    return list(classes.values())
