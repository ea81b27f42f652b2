"""Tensor-parallel communication as symmetric autograd pairs (after Megatron's ``mappings.py``).

Each region op is one collective forward and its adjoint backward:

=============================================  =======================  ==========================
op                                             forward                  backward
=============================================  =======================  ==========================
``copy_to_tensor_parallel_region``             identity                 all-reduce
``reduce_from_tensor_parallel_region``         all-reduce               identity
``scatter_to_tensor_parallel_region``          keep own last-dim chunk  all-gather last dim
``gather_from_tensor_parallel_region``         all-gather last dim      keep own last-dim chunk
``scatter_to_sequence_parallel_region``        keep own seq chunk       all-gather seq dim
``gather_from_sequence_parallel_region``       all-gather seq dim       reduce-scatter seq dim [*]
``reduce_scatter_to_sequence_parallel_region`` reduce-scatter seq dim   all-gather seq dim
=============================================  =======================  ==========================

[*] or "keep own chunk" when ``tensor_parallel_output_grad=False`` (the consumer's gradient
is already identical on every rank).

``group=None`` means the default group; with torch.distributed not initialised, or a group
of size 1, every op is the identity. ``seq_dim`` is the sequence dimension (0 for Megatron's
``[s, b, h]`` layout, 1 for batch-first ``[b, s, h]``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_amp.parallel.groups import group_rank, group_size

# ----------------------------------------------------------------------------------------
# plain collectives (no autograd)
# ----------------------------------------------------------------------------------------


def all_reduce(x: Tensor, group: Any, async_op: bool = False):
    """Sum ``x`` in place over ``group``; returns the work handle when ``async_op`` (else None)."""
    if group_size(group) == 1:
        return None
    return dist.all_reduce(x, group=group, async_op=async_op)


def split_along(x: Tensor, dim: int, group: Any) -> Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim`` (which must divide evenly)."""
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size != 0:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} evenly over {size} ranks")
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


def gather_along(x: Tensor, dim: int, group: Any) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter_along(x: Tensor, dim: int, group: Any, async_op: bool = False):
    """Sum ``x`` over ``group`` and keep this rank's chunk along ``dim``.

    Returns ``(out, handle)``; when ``async_op`` the caller must ``handle.wait()`` before reading
    ``out`` and then take ``finish_reduce_scatter(out, dim)``.
    """
    size = group_size(group)
    if size == 1:
        return x, None
    if x.shape[dim] % size != 0:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} evenly over {size} ranks")
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // size, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    handle = dist.reduce_scatter_tensor(out, moved, group=group, async_op=async_op)
    if handle is not None:
        handle = _KeepAlive(handle, moved)
    return out, handle


class _KeepAlive:
    """A collective's work handle that holds its input until waited on: the backend may still read
    (gloo: and use as scratch) a temporary input, whose memory must not be reused meanwhile."""

    def __init__(self, work: Any, *tensors: Tensor) -> None:
        self.work, self.tensors = work, tensors

    def wait(self) -> Any:
        result = self.work.wait()
        self.tensors = ()
        return result


def finish_reduce_scatter(out: Tensor, dim: int) -> Tensor:
    """Undo the dim move of :func:`reduce_scatter_along` once its collective is complete."""
    return out.movedim(0, dim)


def _reduce_scatter_sync(x: Tensor, dim: int, group: Any) -> Tensor:
    out, _ = reduce_scatter_along(x, dim, group)
    return out if group_size(group) == 1 else finish_reduce_scatter(out, dim)


# ----------------------------------------------------------------------------------------
# autograd pairs
# ----------------------------------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_along(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along(grad, -1, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_along(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return split_along(grad, -1, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, seq_dim):
        ctx.group, ctx.seq_dim = group, seq_dim
        return split_along(x, seq_dim, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along(grad, ctx.seq_dim, ctx.group), None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, seq_dim, tensor_parallel_output_grad):
        ctx.group, ctx.seq_dim, ctx.tp_out_grad = group, seq_dim, tensor_parallel_output_grad
        return gather_along(x, seq_dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tp_out_grad:
            return _reduce_scatter_sync(grad, ctx.seq_dim, ctx.group), None, None, None
        return split_along(grad, ctx.seq_dim, ctx.group), None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, seq_dim):
        ctx.group, ctx.seq_dim = group, seq_dim
        return _reduce_scatter_sync(x, seq_dim, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along(grad, ctx.seq_dim, ctx.group), None, None


def copy_to_tensor_parallel_region(x: Tensor, group: Optional[Any] = None) -> Tensor:
    if group_size(group) == 1:
        return x
    return _CopyToTP.apply(x, group)


def reduce_from_tensor_parallel_region(x: Tensor, group: Optional[Any] = None) -> Tensor:
    if group_size(group) == 1:
        return x
    return _ReduceFromTP.apply(x, group)


def scatter_to_tensor_parallel_region(x: Tensor, group: Optional[Any] = None) -> Tensor:
    if group_size(group) == 1:
        return x
    return _ScatterToTP.apply(x, group)


def gather_from_tensor_parallel_region(x: Tensor, group: Optional[Any] = None) -> Tensor:
    if group_size(group) == 1:
        return x
    return _GatherFromTP.apply(x, group)


def scatter_to_sequence_parallel_region(x: Tensor, group: Optional[Any] = None, seq_dim: int = 0) -> Tensor:
    if group_size(group) == 1:
        return x
    return _ScatterToSP.apply(x, group, seq_dim)


def gather_from_sequence_parallel_region(
    x: Tensor, group: Optional[Any] = None, seq_dim: int = 0, tensor_parallel_output_grad: bool = True
) -> Tensor:
    if group_size(group) == 1:
        return x
    return _GatherFromSP.apply(x, group, seq_dim, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: Tensor, group: Optional[Any] = None, seq_dim: int = 0) -> Tensor:
    if group_size(group) == 1:
        return x
    return _ReduceScatterToSP.apply(x, group, seq_dim)
