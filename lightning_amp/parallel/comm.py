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

Under ``torch.compile`` (:func:`tracing`) the collectives are torch's traceable functional ones
(``torch.distributed._functional_collectives``: out of place, each followed by its ``wait_tensor`` in
the graph, which the compiler may move), so forward and backward of every pair trace into the graph
without a break; eager calls run the c10d collectives exactly as before. A trace has no work handles:
there :func:`all_reduce` with ``async_op=True`` and :func:`reduce_scatter_along` refuse, and callers
take :func:`all_reduce_value` and :func:`reduce_scatter_value`.

**One entry for the column layers that read one input** (Megatron's collective count, :class:`SharedInput`). Each
column-parallel layer's backward all-reduces the gradient of its input over the TP group (reduce-scatters it under
sequence parallelism). Layers that read the *same* input (``q``, ``k``, ``v``; ``gate``, ``up``) would do that once
each: 5 all-reduces per Llama block where Megatron's layers do 2. A :class:`SharedInput` given to the columns of one
unit puts their input into the TP region once (:func:`copy_to_tensor_parallel_region`, or
:func:`gather_from_sequence_parallel_region`) and hands every layer of the unit that reads that same tensor the same
result; the layers then run their GEMM with no collective of their own (the replicated key/value rows of a fused
``[q | k | v]``, :mod:`~lightning_amp.parallel.fused_qkv`, take the same entry as its query rows). Autograd sums their
input gradients into the region's output, and the region's backward reduces the sum once: the adjoint of one copy read
several times is the sum of the reads' gradients, so the result equals the layers' own collectives. A layer given
another tensor (an input the unit's other layers do not read) gets a region of its own: the rule is exact whatever the
forward does. With gradients off (no backward) nothing is kept; what is kept are weak references, so the input is not
held past the step. Under ``torch.compile`` the layers take their own collectives (a traced graph has no object
identity to compare).
"""
from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from lightning_amp.parallel.groups import group_rank, group_size

# ----------------------------------------------------------------------------------------
# plain collectives (no autograd)
# ----------------------------------------------------------------------------------------


def tracing() -> bool:
    """Whether dynamo is tracing the caller (``torch.compile``): the collectives are then functional."""
    return torch.compiler.is_compiling()


def _traced_group(group: Any) -> Any:
    """``group`` as the functional collectives take it (they have no default group)."""
    return dist.group.WORLD if group is None else group


def all_reduce(x: Tensor, group: Any, async_op: bool = False):
    """Sum ``x`` in place over ``group``; returns the work handle when ``async_op`` (else None).

    Under a trace: the functional all-reduce copied back into ``x`` (``async_op`` refused, see
    :func:`all_reduce_value`)."""
    if group_size(group) == 1:
        return None
    if tracing():
        if async_op:
            raise RuntimeError("comm.all_reduce: async_op=True cannot be traced; use all_reduce_value")
        x.copy_(funcol.all_reduce(x, "sum", _traced_group(group)))
        return None
    return dist.all_reduce(x, group=group, async_op=async_op)


def all_reduce_value(x: Tensor, group: Any) -> Tensor:
    """The sum of ``x`` over ``group`` as a new tensor (``x`` itself when the group has one rank).

    Eager: a contiguous copy of ``x`` (what the collective needs) summed in place. Under a trace: the functional
    all-reduce."""
    if group_size(group) == 1:
        return x
    if tracing():
        return funcol.all_reduce(x, "sum", _traced_group(group))
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


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
    if tracing():  # gathered along dim 0, then re-cut here: torch 2.11's dynamo refuses funcol's own re-cut
        out = funcol.all_gather_tensor(x, 0, _traced_group(group))
        return out if dim == 0 else torch.cat(out.chunk(size, dim=0), dim=dim)
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter_along(x: Tensor, dim: int, group: Any, async_op: bool = False):
    """Sum ``x`` over ``group`` and keep this rank's chunk along ``dim``.

    Returns ``(out, handle)``; when ``async_op`` the caller must ``handle.wait()`` before reading
    ``out`` and then take ``finish_reduce_scatter(out, dim)``. Not under a trace: see
    :func:`reduce_scatter_value`.
    """
    size = group_size(group)
    if size == 1:
        return x, None
    if x.shape[dim] % size != 0:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} evenly over {size} ranks")
    if tracing():
        raise RuntimeError("comm.reduce_scatter_along cannot be traced; use reduce_scatter_value")
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
    """Undo the dim move of :func:`reduce_scatter_along` once its collective is complete (``out`` itself for dim 0,
    else a view of it)."""
    return out if dim == 0 else out.movedim(0, dim)


def reduce_scatter_value(x: Tensor, dim: int, group: Any) -> Tensor:
    """This rank's chunk along ``dim`` of the sum of ``x`` over ``group`` (``x`` itself for one rank).

    Eager: the synchronous :func:`reduce_scatter_along`. Under a trace: the functional reduce-scatter."""
    size = group_size(group)
    if size == 1:
        return x
    if tracing():
        if x.shape[dim] % size != 0:
            raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} evenly over {size} ranks")
        return funcol.reduce_scatter_tensor(x.contiguous(), "sum", dim, _traced_group(group))
    out, _ = reduce_scatter_along(x, dim, group)
    return finish_reduce_scatter(out, dim)


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
        return all_reduce_value(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_value(x, group)

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


# The sequence-parallel regions' outputs are tensors of their own, never views: the model may write into them in place
# (Falcon's ``mlp_output += attention_output`` on a row layer's reduce-scattered output), which autograd refuses for a
# view made inside a Function. A chunk along dim 0 is such a view (cloned); along another dim it was copied already.
# Under a trace the reduce-scatter is the functional collective, whose result is its own; a ``contiguous()`` of it
# there gave wrong values under torch 2.11's aot_eager (every element: tests/parallel/test_tp_compile.py).

class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, seq_dim):
        ctx.group, ctx.seq_dim = group, seq_dim
        out = split_along(x, seq_dim, group)
        return out.clone() if seq_dim == 0 else out

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
            return reduce_scatter_value(grad, ctx.seq_dim, ctx.group), None, None, None
        return split_along(grad, ctx.seq_dim, ctx.group), None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, seq_dim):
        ctx.group, ctx.seq_dim = group, seq_dim
        out = reduce_scatter_value(x, seq_dim, group)
        return out if tracing() else out.contiguous()  # traced: the functional collective's own tensor already

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


class SharedInput:
    """The TP-region entry shared by the column-parallel layers of one unit, for ``group`` (see the module
    docstring); ``sequence_parallel``: the input arrives split along ``sequence_dim`` and is all-gathered here."""

    def __init__(self, group: Any, sequence_parallel: bool = False, sequence_dim: int = 0) -> None:
        self.group, self.sequence_parallel, self.sequence_dim = group, sequence_parallel, sequence_dim
        self._last: Optional[tuple[weakref.ref, weakref.ref]] = None  # (input, its region output) of this forward

    def __call__(self, x: Tensor) -> Tensor:
        if self._last is not None and self._last[0]() is x:
            entered = self._last[1]()
            if entered is not None:
                return entered
        if self.sequence_parallel:
            entered = gather_from_sequence_parallel_region(x, self.group, self.sequence_dim)
        else:
            entered = copy_to_tensor_parallel_region(x, self.group)
        self._last = (weakref.ref(x), weakref.ref(entered)) if torch.is_grad_enabled() else None
        return entered

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _last=None)

    def __repr__(self) -> str:
        return f"SharedInput(sequence_parallel={self.sequence_parallel}, sequence_dim={self.sequence_dim})"
