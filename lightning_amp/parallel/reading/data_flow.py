"""Walks along the data of a :class:`~lightning_amp.parallel.reading.forward_graph.ForwardGraph`: which projections a value
is computed from, where a projection's output goes, and the attention products of a forward.

Shapes, sizes and dtypes read off a tensor (``x.shape[:-1]`` for a reshape) are not its data: the walks do not follow
them, so a reshape that reads the query's shape does not make the key depend on the query.
"""
from __future__ import annotations

import operator
from typing import Iterable

import torch
import torch.fx as fx
import torch.nn.functional as F

from lightning_amp.parallel.reading.between import _elementwise
from lightning_amp.parallel.reading.folded_heads import baddbmm_operands, unfolds_scores
from lightning_amp.parallel.reading.forward_graph import ForwardGraph

_SOFTMAX = frozenset({F.softmax, torch.softmax, torch.Tensor.softmax, "softmax"})
_MATMUL = frozenset({torch.matmul, operator.matmul, torch.bmm, "matmul", "bmm", torch.Tensor.matmul})
#: ops that may lie between the attention scores and the softmax, and between the softmax and the product with v
_SCORE_OPS = frozenset({"masked_fill", "masked_fill_", "float", "to", "type_as", "type", "half", "bfloat16",
                        F.dropout, torch.where, torch.masked_fill})
#: ``bias.baddbmm(q, k^T)``: scores with an additive bias (BLOOM's ALiBi), heads folded into the batch
_BADDBMM = frozenset({torch.baddbmm, "baddbmm"})


def reach(nodes: Iterable[fx.Node], step, stop=lambda node: False) -> set:
    """Every node reached from ``nodes`` by ``step`` (``users`` or ``all_input_nodes``), not going past ``stop``."""
    seen, todo = set(), [m for n in nodes for m in step(n)]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if not stop(node):
            todo.extend(step(node))
    return seen


def _calls(node: fx.Node, targets: frozenset) -> bool:
    return node.op in ("call_function", "call_method") and node.target in targets


def _score_op(fg: ForwardGraph, node: fx.Node) -> bool:
    return _calls(node, _SCORE_OPS) or unfolds_scores(fg, node) or (
        node.op in ("call_function", "call_method", "call_module") and _elementwise(fg.module, node))


_SHAPE_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "layout"})


def carries_data(fg: ForwardGraph, node: fx.Node) -> bool:
    """Whether ``node`` is a tensor (or holds tensors), not a shape, size or dtype read off one: a reshape's sizes
    do not carry the values of the tensor they were read from."""
    value = fg.value(node)
    if value is not None:
        return isinstance(value, torch.Tensor) or (isinstance(value, (tuple, list)) and
                                                   any(isinstance(v, torch.Tensor) for v in value))
    if node.op == "call_function" and node.target is getattr and len(node.args) > 1:
        return node.args[1] not in _SHAPE_ATTRS
    return not (node.op == "call_method" and node.target in ("size", "dim", "numel"))


def data_inputs(fg: ForwardGraph, node: fx.Node) -> list:
    return [n for n in node.all_input_nodes if carries_data(fg, n)]


def data_users(fg: ForwardGraph, node: fx.Node) -> list:
    return [n for n in node.users if carries_data(fg, n)]


def sources(fg: ForwardGraph, node: fx.Node) -> set:
    """The projection nodes ``node`` is computed from (along the data, through anything but other projections)."""
    seen = reach([node], lambda n: data_inputs(fg, n), stop=lambda n: fg.layer(n) is not None) | {node}
    return {n for n in seen if fg.layer(n) is not None}


def products(fg: ForwardGraph) -> list[tuple[fx.Node, fx.Node, fx.Node, fx.Node]]:
    """(query, key, value, result) of every attention product: ``F.scaled_dot_product_attention`` or
    ``softmax(q @ k^T ...) @ v`` (scaling, masking, dtype casts and dropout around the softmax)."""
    found = []
    for node in fg.graph.nodes:
        if node.op == "call_function" and node.target is F.scaled_dot_product_attention:
            args = list(node.args[:3]) + [node.kwargs.get(k) for k in ("query", "key", "value")][len(node.args[:3]):]
            if all(isinstance(a, fx.Node) for a in args):
                found.append((args[0], args[1], args[2], node))
        elif _calls(node, _SOFTMAX) and node.args and isinstance(node.args[0], fx.Node):
            match = _softmax_product(fg, node)
            if match is not None:
                found.append(match)
    return found


def _softmax_product(fg: ForwardGraph, softmax: fx.Node):
    scores = {n for n in reach([softmax], lambda n: data_inputs(fg, n), stop=lambda n: not _score_op(fg, n))
              if _calls(n, _MATMUL | _BADDBMM)}
    product = {n for n in reach([softmax], lambda n: data_users(fg, n), stop=lambda n: not _score_op(fg, n))
               if _calls(n, _MATMUL)}
    if len(scores) != 1 or len(product) != 1:
        return None
    (scores,), (product,) = scores, product
    q, k = baddbmm_operands(scores) if _calls(scores, _BADDBMM) else scores.args[:2]
    v = product.args[1] if len(product.args) > 1 else None
    if not all(isinstance(a, fx.Node) for a in (q, k, v)) or v in reach([softmax], lambda n: n.users):
        return None
    return q, k, v, product
