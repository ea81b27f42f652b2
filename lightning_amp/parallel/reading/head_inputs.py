"""Per-head inputs of an attention, found: a tensor the forward is given (not a weight) that meets the attention
scores, such as an ALiBi bias built once for all heads outside the attention (BLOOM's ``alibi``, MPT's
``position_bias``). After the split a rank computes its own heads only, so such an input must reach it cut to those
heads (:mod:`~lightning_amp.parallel.head_input_slicer` cuts it; the plan value carries what is found here).

:func:`find_head_inputs` reads which inputs of the attention's forward reach its scores (between ``q @ k^T`` and the
softmax) and where: the scores' dimension of heads is their third-to-last one, holding the heads alone
(``[batch, heads, q, k]``: MPT) or the batch and the heads folded, batch first (``[batch * heads, q, k]``: BLOOM's
``bias.baddbmm(q, k^T)``). Broadcasting aligns an input with the scores from the last dimension, so its own
third-to-last dimension is the one to cut. Only an input that reaches the scores through slicing and dtype casts alone
is cut (one reshaped on the way, as a padding mask ``[batch, keys]`` viewed ``[batch, 1, 1, keys]``, is passed as it
is: one holding per-head entries then fails the rank's forward on a shape, never silently).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch.fx as fx
import torch.nn.functional as F

from lightning_amp.parallel.reading.dataflow import READ_BATCH, ForwardGraph, data_inputs, data_users, folded, reach

_CASTS = frozenset({"to", "type_as", "float", "half", "bfloat16", "contiguous"})


@dataclass(frozen=True)
class HeadInput:
    """The input ``name`` of the attention's forward, whose third-to-last dimension holds the heads, or the batch and
    the heads folded batch first (``folded``)."""

    name: str
    folded: bool


def find_head_inputs(graph: ForwardGraph, product: tuple, n_head: int) -> tuple[tuple[HeadInput, ...], Optional[str]]:
    """The inputs of the forward read in ``graph`` that meet the scores of ``product`` ((q, k, v, result), with
    ``n_head`` query heads), not through the query or the key (a rotary table), and why they cannot be cut by heads
    (None when they can)."""
    q, k, _, result = product
    region = (reach([q], lambda n: data_users(graph, n)) & reach([k], lambda n: data_users(graph, n))
              & reach([result], lambda n: data_inputs(graph, n)))
    scores = {n: graph.shape(n) for n in region}
    mask = _sdpa_mask(result)
    if mask is not None:  # F.scaled_dot_product_attention(q, k, v, attn_mask): added to [batch, heads, q, k] scores
        scores[mask] = (0, 0, 0, 0)
    upstream = reach([q, k], lambda n: data_inputs(graph, n)) | {q, k}
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    found = []
    for node in placeholders[1:]:
        if node.target.startswith("*"):
            continue  # ``*args``/``**kwargs``: read as empty
        path = reach([node], lambda n: data_users(graph, n), stop=lambda n: n in scores or n in upstream) | {node}
        joins = [n for n in path if n in scores]
        if not joins:
            continue
        name = node.target
        on_the_way = path & reach(joins, lambda n: data_inputs(graph, n)) - {node}
        if not all(_keeps_dims(n) for n in on_the_way):
            continue  # reshaped on the way (a padding mask [batch, keys] viewed [batch, 1, 1, keys]): left as before
        shapes = {scores[n] for n in joins}
        if None in shapes or len({folded(s) for s in shapes}) != 1:
            return (), f"the shape of the attention scores where its input {name!r} meets them is not known"
        fold = folded(next(iter(shapes)))
        if fold and not _batch_first(graph, q, n_head):
            return (), (f"its input {name!r} meets scores whose heads are folded into the batch, but the reading "
                        f"cannot tell that the batch comes first (heads {n_head}, batch {READ_BATCH})")
        found.append(HeadInput(name, fold))
    return tuple(found), None


def _sdpa_mask(result: fx.Node) -> Optional[fx.Node]:
    if not (result.op == "call_function" and result.target is F.scaled_dot_product_attention):
        return None
    mask = result.args[3] if len(result.args) > 3 else result.kwargs.get("attn_mask")
    return mask if isinstance(mask, fx.Node) else None


def _keeps_dims(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target is operator.getitem:
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        return all(isinstance(i, slice) or i is Ellipsis for i in index)
    return node.op == "call_method" and node.target in _CASTS


def _batch_first(graph: ForwardGraph, q: fx.Node, n_head: int) -> bool:
    """Whether the query was folded from ``[batch, heads, ...]`` (the first 4-dimensional value it comes from)."""
    node = q
    while True:
        shape = graph.shape(node)
        if shape is not None and len(shape) >= 4:
            return tuple(shape[:2]) == (READ_BATCH, n_head) and n_head != READ_BATCH
        inputs = data_inputs(graph, node)
        if len(inputs) != 1:
            return False
        node = inputs[0]
