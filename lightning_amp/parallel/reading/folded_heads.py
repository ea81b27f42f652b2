"""Attention products whose heads are folded into the batch: ``bias.baddbmm(q, k^T)`` and ``bmm`` on
``[batch * heads, sequence, head_size]`` (BLOOM), read as the products of
:func:`~lightning_amp.parallel.reading.data_flow.products` are.

The reading gives the first input ``(batch, sequence, hidden)`` with ``batch = 2``
(:data:`~lightning_amp.parallel.reading.forward_graph.READ_BATCH`): a product input of 4 or more dimensions holds its heads in
its third-to-last one; a 3-dimensional one ``[batch * heads, ...]`` holds ``heads = dim 0 / batch`` (one head when
nothing was folded: ``[batch, sequence, head_size]``).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from lightning_amp.parallel.reading.forward_graph import READ_BATCH, ForwardGraph

_UNFOLD = frozenset({"view", "reshape", torch.reshape})


def heads_at(shape: tuple[int, ...]) -> int:
    """The head count a product input of ``shape`` (read with the reading's batch) holds (see the module docstring)."""
    return shape[-3] if len(shape) >= 4 else shape[0] // READ_BATCH


def folded(shape: tuple[int, ...]) -> bool:
    return len(shape) == 3


def baddbmm_operands(node: fx.Node) -> tuple:
    """(batch1, batch2) of ``torch.baddbmm(input, batch1, batch2)`` or ``input.baddbmm(batch1, batch2)``."""
    args = list(node.args[1:3]) + [node.kwargs.get(k) for k in ("batch1", "batch2")][len(node.args[1:3]):]
    return args[0], args[1]


def unfolds_scores(fg: ForwardGraph, node: fx.Node) -> bool:
    """Whether ``node`` only refolds heads and batch of attention scores (``scores.view(batch, heads, q, -1)`` and
    back): a view or reshape that keeps the last dimension (the keys the softmax runs over) and the element count."""
    if node.op not in ("call_function", "call_method") or node.target not in _UNFOLD or not node.args:
        return False
    before = fg.shape(node.args[0]) if isinstance(node.args[0], fx.Node) else None
    after = fg.shape(node)
    return (before is not None and after is not None and len(before) >= 3 and len(after) >= 3
            and before[-1] == after[-1] and before[-2] == after[-2])
