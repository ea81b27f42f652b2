"""The graph of a read forward (:class:`ForwardGraph`, made by
:func:`~lightning_amp.parallel.reading.forward_graph.read_forward`), the ops that act elementwise (:data:`ELEMENTWISE`
modules, functions and tensor methods, which a column layer's shard may pass through), the walks along its data, and
what one pass of them shows: :func:`read_flows`.

**Walks** (:func:`sources`, :func:`data_inputs`, :func:`data_users`, :func:`reach`): which projections a value is
computed from, where a projection's output goes, and the attention products of a forward (:func:`products`). Shapes,
sizes and dtypes read off a tensor (``x.shape[:-1]`` for a reshape) are not its data: the walks do not follow them, so
a reshape that reads the query's shape does not make the key depend on the query.

**Heads folded into the batch**: attention products ``bias.baddbmm(q, k^T)`` and ``bmm`` on ``[batch * heads,
sequence, head_size]`` (BLOOM) are products too. The first input is read with ``batch = 2`` (:data:`READ_BATCH`): a
product input of 4 or more dimensions holds its heads in its third-to-last one; a 3-dimensional one ``[batch * heads,
...]`` holds ``heads = dim 0 / batch`` (one head when nothing was folded: ``[batch, sequence, head_size]``)
(:func:`heads_at`).

**Flows** (:func:`read_flows`): the facts :mod:`~lightning_amp.parallel.reading.structure` decides units from, read in
one pass over a graph: its projections, every attention product whose query, key and value each come from one
projection with the projections its result reaches, and per projection where its output goes through elementwise ops
(the column -> row pairs of an MLP, or what stops one).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from torch import nn

_UNKNOWN = object()  # a value the reading could not know
READ_BATCH = 2  # the batch of the first input a forward is read with (see forward_graph)


@dataclass
class ForwardGraph:
    """The fx graph of one forward with what was known about each node (:meth:`value`)."""

    module: nn.Module
    graph: fx.Graph
    values: dict = field(default_factory=dict)  # node -> meta value
    errors: dict = field(default_factory=dict)  # node -> the exception of an op whose inputs were all known
    layers: dict = field(default_factory=dict)  # call_module node -> the projection (Linear/Conv1D) it calls

    def value(self, node: fx.Node) -> Any:
        """The node's value on meta tensors (a tensor, a shape, an int...), or None when unknown."""
        value = self.values.get(node, _UNKNOWN)
        return None if value is _UNKNOWN else value

    def shape(self, node: fx.Node) -> Optional[tuple[int, ...]]:
        value = self.value(node)
        return tuple(value.shape) if isinstance(value, torch.Tensor) else None

    def layer(self, node: fx.Node) -> Optional[nn.Module]:
        """The projection (Linear/Conv1D) a ``call_module`` node calls, or None."""
        return self.layers.get(node)


#: modules that act elementwise (a column layer's shard may pass through them)
ELEMENTWISE = (
    nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.LeakyReLU, nn.Mish, nn.ELU, nn.Softplus,
    nn.Hardswish, nn.Identity, nn.ReLU6, nn.SELU, nn.CELU, nn.Hardtanh,
)
_ELEMENTWISE_FUNCTIONS = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.exp, torch.erf, torch.tanh,
    torch.sigmoid, torch.relu, torch.clamp, torch.sqrt, torch.abs,
    F.relu, F.gelu, F.silu, F.mish, F.elu, F.selu, F.celu, F.leaky_relu, F.relu6, F.hardswish, F.hardtanh,
    F.softplus, F.sigmoid, F.tanh, F.dropout,
})
_ELEMENTWISE_METHODS = frozenset({
    "add", "sub", "mul", "div", "neg", "pow", "exp", "tanh", "sigmoid", "relu", "clamp", "sqrt", "abs",
    "float", "half", "bfloat16", "to", "type", "type_as", "contiguous",
})


def _elementwise(owner: nn.Module, node) -> bool:
    if node.op == "call_module":
        return isinstance(owner.get_submodule(node.target), ELEMENTWISE)
    if node.op == "call_function":
        return node.target in _ELEMENTWISE_FUNCTIONS
    if node.op == "call_method":
        return node.target in _ELEMENTWISE_METHODS
    return False


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


# ------------------------------------------------------------------------------------------- heads folded into the batch

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


# ------------------------------------------------------------------------------------------- flows: one pass

@dataclass
class Attention:
    """An attention product whose query, key and value each come from one projection: their paths (relative to the
    module read; two or three of them equal when a projection is fused), and the projections its result reaches."""

    qkv: tuple[str, str, str]
    outputs: list[str]


@dataclass
class Flow:
    """Where the output of one projection goes through elementwise ops (and equal cuts of its last dimension).

    ``reached``: the projections it gets to; ``blocker``: the first other consumer, described ("the output of ...",
    "path (Class)", a function's name), or None; when it reaches exactly one projection, the ``row``: ``columns``, the
    projections the row is computed from (in graph order), ``clean`` (each reaches the row alone), ``foreign`` (the
    first value the row reads that is no elementwise function of the columns, described, or None) and ``cuts`` (per
    column, the equal blocks its output is cut into: 1 when not cut)."""

    reached: list[str]
    blocker: Optional[str] = None
    row: Optional[str] = None
    columns: list[str] = field(default_factory=list)
    clean: bool = False
    foreign: Optional[str] = None
    cuts: dict[str, int] = field(default_factory=dict)


@dataclass
class Flows:
    """What :func:`read_flows` found in one graph (paths relative to the module read)."""

    layers: list[str]
    attentions: list[Attention]
    flows: dict[str, Flow]


def read_flows(fg: ForwardGraph, base: str) -> Flows:
    """The projections, attention products and projection flows of ``fg`` (see the module docstring); ``base``: the
    read module's path in the model, for the descriptions."""
    layer_nodes = [n for n in fg.graph.nodes if fg.layer(n) is not None]
    attentions = []
    for q, k, v, result in products(fg):
        streams = [sources(fg, a) for a in (q, k, v)]
        if any(len(s) != 1 for s in streams):
            continue  # not projections of one input each (a cached key, a mask): not ours to split
        outputs = reach([result], lambda n: data_users(fg, n), stop=lambda n: fg.layer(n) is not None)
        attentions.append(Attention(tuple(next(iter(s)).target for s in streams),
                                    [n.target for n in layer_nodes if n in outputs]))
    closures = {node: _closure(fg, node) for node in layer_nodes}
    rows: dict[fx.Node, tuple] = {}  # per row reached: what every column feeding it shares (read once per row)
    flows = {}
    for node in layer_nodes:
        reached, blockers = closures[node]
        flow = flows[node.target] = Flow([n.target for n in reached])
        if blockers:
            flow.blocker = _describe(fg, base, blockers[0])
        if blockers or len(reached) != 1:
            continue
        row = reached[0]
        if row not in rows:
            feeding = sources(fg, row)
            columns = [n for n in layer_nodes if n in feeding and n is not row]
            foreign = _foreign_input(fg, row, columns)
            rows[row] = ([c.target for c in columns], all(closures[c] == ([row], []) for c in columns),
                         _describe(fg, base, foreign) if foreign is not None else None,
                         {c.target: _cut(fg, c) for c in columns})
        flow.row = row.target
        flow.columns, flow.clean, flow.foreign, flow.cuts = rows[row]
    return Flows([n.target for n in layer_nodes], attentions, flows)


def _closure(fg: ForwardGraph, start: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """Where the output of the projection ``start`` goes through elementwise ops: (projections, other consumers)."""
    layers, blockers, seen, todo = [], [], set(), data_users(fg, start)
    while todo:
        node = todo.pop(0)
        if node in seen:
            continue
        seen.add(node)
        if fg.layer(node) is not None:
            layers.append(node)
        elif _passes(fg, node):
            todo.extend(data_users(fg, node))
        else:
            blockers.append(node)
    return layers, blockers


def _blocks(fg: ForwardGraph, node: fx.Node) -> int:
    """How many equal blocks ``node`` cuts its input's last dimension into (``chunk``/``split`` along it: a fused
    ``[gate | up]``), else 0."""
    if node.op not in ("call_function", "call_method") or node.target not in ("chunk", "split", torch.chunk,
                                                                               torch.split) or not node.args:
        return 0
    value, source = fg.value(node), fg.shape(node.args[0]) if isinstance(node.args[0], fx.Node) else None
    if not isinstance(value, (tuple, list)) or len(value) < 2 or source is None:
        return 0
    shapes = {tuple(t.shape) for t in value if isinstance(t, torch.Tensor)}
    if len(shapes) != 1 or len(value) * value[0].shape[-1] != source[-1] or value[0].shape[:-1] != source[:-1]:
        return 0
    return len(value)


def _passes(fg: ForwardGraph, node: fx.Node) -> bool:
    """Whether a shard passes ``node`` as it is: an elementwise op, or a cut into equal blocks of the last dimension
    (and the indexing that takes one block), each of which a rank then holds its slice of."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return _blocks(fg, node.args[0]) > 0 and isinstance(node.args[1], int)
    return _blocks(fg, node) > 0 or (node.op in ("call_function", "call_method", "call_module")
                                     and _elementwise(fg.module, node))


def _cut(fg: ForwardGraph, column: fx.Node) -> int:
    """The number of equal blocks the output of ``column`` is cut into on its way (1: not cut)."""
    cuts = {_blocks(fg, n) for n in reach([column], lambda n: data_users(fg, n), stop=lambda n: fg.layer(n) is not None)}
    return max(cuts - {0}, default=1)


def _foreign_input(fg: ForwardGraph, row: fx.Node, columns: list[fx.Node]) -> Optional[fx.Node]:
    """The first value the row's input is computed from that is not the output of one of ``columns`` through
    elementwise ops (a residual added to the shard, a weight over the split features), or None. Scalars pass."""
    todo, seen = data_inputs(fg, row), set()
    while todo:
        node = todo.pop()
        if node in seen or node in columns:
            continue
        seen.add(node)
        shape = fg.shape(node)
        if node.op == "get_attr" and shape is not None and not shape:
            continue  # a scalar
        if fg.layer(node) is None and _passes(fg, node):
            todo.extend(data_inputs(fg, node))
        else:
            return node
    return None


def _describe(fg: ForwardGraph, base: str, node: fx.Node) -> str:
    if node.op == "output":
        return "the output of " + (base or "the model")
    if node.op == "call_module":
        return f"{'.'.join(p for p in (base, node.target) if p)} ({type(fg.module.get_submodule(node.target)).__name__})"
    return f"{getattr(node.target, '__name__', node.target)}"
