"""Attention blocks and MLPs found by what a forward computes, whatever their layers and attributes are called.

:func:`find_structural_units` reads modules with :func:`~lightning_amp.parallel.reading.forward_graph.read_forward`, from the
model down (a module read whole covers every module under it; one that cannot be read is passed over for its
children), and finds in each graph:

* **attention**: an attention product, ``F.scaled_dot_product_attention(q, k, v)`` or ``softmax(q @ k^T ...) @ v``,
  whose query, key and value each come from one projection (three projections, or one fused projection split into
  ``[q | k | v]`` by ``split``/``chunk`` or viewed ``(..., 3, heads, head_size)``), and the one projection that
  consumes its result: the out-projection. Nothing but elementwise ops may lie between a projection and the reshape
  that splits its features into heads. The head size is the last dimension of the product's inputs, the head counts
  follow from the projections' widths (:mod:`~lightning_amp.parallel.reading.heads` finds the attributes the forward reads
  for its reshapes and the values one rank needs);
* **MLP**: projections whose outputs reach one other projection through elementwise ops only (``fc1 -> gelu ->
  fc2``, ``w2(silu(w1(x)) * w3(x))``): column-parallel, then row-parallel.

Projections found in neither are left whole, each with the reason (:attr:`StructuralPlan.whole`). An attention
whose heads cannot be split is a :class:`~lightning_amp.parallel.reading.families.Unit` with its ``problem`` set: the plan
refuses it by name.
"""
from __future__ import annotations

import collections
import operator
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
import torch.fx as fx
from torch import nn

from lightning_amp.parallel.reading.families import Unit
from lightning_amp.parallel.reading.forward_graph import (ForwardGraph, ForwardUnreadable, _elementwise, data_inputs,
                                                          data_users, is_conv1d, is_projection, products, reach,
                                                          read_forward, sources, widths_of)
from lightning_amp.parallel.reading.heads import attention_unit


@dataclass
class StructuralPlan:
    """What :func:`find_structural_units` found: the units and, per projection left whole, why."""

    units: list[Unit] = field(default_factory=list)
    whole: dict[str, str] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)  # module path -> fx's reason
    seen: set = field(default_factory=set)  # projections some reading showed


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _leaf(module: nn.Module) -> bool:
    return is_projection(module) or isinstance(module, nn.MultiheadAttention) or (
        module.__module__.startswith("torch.nn") and not isinstance(module, (nn.Sequential, nn.ModuleList,
                                                                              nn.ModuleDict)))


def _hidden(module: nn.Module) -> Optional[int]:
    """The width of the module's first input, guessed as the input width its projections share most."""
    widths = collections.Counter(widths_of(m)[0] for m in module.modules() if is_projection(m))
    return widths.most_common(1)[0][0] if widths else None


def find_structural_units(model: nn.Module, claimed: Iterable[str], tp: int) -> StructuralPlan:
    """Units of the projections of ``model`` not in ``claimed`` (module paths), found by structure (see the module
    docstring); ``tp``: the tensor-parallel size their head counts must split over. Modules are read parents first;
    a module whose reading leaves two or more of its projections unexplained (a branch the reading took, such as a
    KV cache, hid them) is read itself, and the reason a projection is left whole comes from the innermost reading."""
    claimed = set(claimed)
    found = StructuralPlan()
    notes: dict[str, str] = {}
    layouts: dict[str, str] = {}  # an attention's projections in a layout the plan does not split: that is why
    cache: dict = {}  # attentions of one class and attribute values are read once
    for path, module in model.named_modules():  # parents first; a child is read when its parent left it unexplained
        if _leaf(module):
            continue
        free = [p for p, m in module.named_modules() if is_projection(m) and _join(path, p) not in claimed]
        if len(free) < 2:
            continue
        try:
            graph = read_forward(module, _hidden(module))
        except ForwardUnreadable as error:
            found.unreadable[path] = str(error)
            continue
        found.seen.update(_join(path, n.target) for n in graph.graph.nodes if graph.layer(n) is not None)
        for unit in _attention_units(model, path, graph, claimed, tp, cache, layouts):
            claimed.update(unit.members)
            found.units.append(unit)
        for unit in _mlp_units(path, graph, claimed, notes, tp):
            claimed.update(unit.members)
            found.units.append(unit)
    for path, module in model.named_modules():
        if is_projection(module) and path not in claimed:
            found.whole[path] = layouts.get(path) or notes.get(path) or _unread_reason(path, found.unreadable)
    return found


def _unread_reason(path: str, unreadable: dict[str, str]) -> str:
    owners = [p for p in unreadable if p == "" or path.startswith(p + ".")]
    if not owners:
        return "no other layer of its module: nothing to pair it with"
    owner = max(owners, key=len)
    return (f"torch.fx cannot read the forward of {owner or 'the model'} ({unreadable[owner][:120]}) and no known "
            "layout names it")


# ------------------------------------------------------------------------------------------------- attention

def _attention_units(model: nn.Module, base: str, fg: ForwardGraph, claimed: set, tp: int, cache: dict,
                     notes: dict[str, str]) -> list[Unit]:
    units = []
    for q, k, v, result in products(fg):
        streams = [sources(fg, a) for a in (q, k, v)]
        if any(len(s) != 1 for s in streams):
            continue  # not projections of one input each (a cached key, a mask): not ours to split
        layers = [next(iter(s)) for s in streams]
        outputs = reach([result], lambda n: data_users(fg, n), stop=lambda n: fg.layer(n) is not None)
        out_layers = [n for n in outputs if fg.layer(n) is not None]
        names = [_join(base, n.target) for n in layers + out_layers]
        if claimed.intersection(names) or len(out_layers) != 1:
            continue
        if len({n.target for n in layers}) == 2:  # key and value fused, query apart (or the like)
            for name in names:
                _note(notes, name, "an attention whose query, key and value come from two projections (one fused "
                                   "for two of them): not a layout tp_fused splits")
            continue
        members = list(dict.fromkeys(_join(base, n.target) for n in layers))
        units.append(attention_unit(model, members, _join(base, out_layers[0].target), tp, cache))
    return units


# ------------------------------------------------------------------------------------------------- MLP

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


def _note(notes: dict[str, str], name: str, reason: str) -> None:
    notes[name] = reason  # readings go parents first: the innermost one's reason stands


def _describe(fg: ForwardGraph, base: str, node: fx.Node) -> str:
    if node.op == "output":
        return "the output of " + (base or "the model")
    if node.op == "call_module":
        return f"{_join(base, node.target)} ({type(fg.module.get_submodule(node.target)).__name__})"
    return f"{getattr(node.target, '__name__', node.target)}"


def _mlp_units(base: str, fg: ForwardGraph, claimed: set, notes: dict[str, str], tp: int) -> list[Unit]:
    units: list[Unit] = []
    taken = set(claimed)
    layer_nodes = [n for n in fg.graph.nodes if fg.layer(n) is not None and _join(base, n.target) not in taken]
    for node in layer_nodes:
        name = _join(base, node.target)
        if name in taken:
            continue
        reached, blockers = _closure(fg, node)
        if blockers:
            if blockers[0].op == "output":
                _note(notes, name, f"its output leaves {base or 'the model'} with no layer after it to take a shard "
                                   "(a vocabulary head or a classifier stays whole)")
            else:
                _note(notes, name, f"its output goes through {_describe(fg, base, blockers[0])}, not an elementwise "
                                   "op, before any other layer")
            continue
        if len(reached) != 1:
            _note(notes, name, "its output feeds " + (", ".join(_join(base, n.target) for n in reached) or
                                                          "no other layer"))
            continue
        row = reached[0]
        row_name = _join(base, row.target)
        columns = [n for n in sources(fg, row) if n is not row]
        bad = [c for c in columns if _join(base, c.target) in taken or _closure(fg, c) != ([row], [])]
        foreign = _foreign_input(fg, row, columns)
        if row_name in taken or bad or node not in columns or foreign is not None:
            what = _describe(fg, base, foreign) if foreign is not None else "the output of another layer"
            _note(notes, name, f"{row_name} also reads {what}, not only elementwise functions of its output")
            continue
        width = widths_of(fg.layer(row))[0]
        names = [_join(base, c.target) for c in sorted(columns, key=lambda c: layer_nodes.index(c)
                                                       if c in layer_nodes else 0)]
        cuts = {_join(base, c.target): _cut(fg, c) for c in columns}
        if any(widths_of(fg.layer(c))[1] != width * cuts[_join(base, c.target)] for c in columns):
            _note(notes, name, f"its width differs from what {row_name} takes")
            continue
        if width % tp:
            _note(notes, name, f"an MLP with {row_name}, but its {width} features do not divide by "
                                   f"tensor_parallel_size={tp}")
            continue
        transposed = {n for n, c in zip(names, columns) if is_conv1d(fg.layer(c))}
        if is_conv1d(fg.layer(row)):
            transposed.add(row_name)
        units.append(Unit("MLP", names, [row_name], transposed=transposed, found_by="structure",
                          chunks={n: k for n, k in cuts.items() if k > 1}, divisible=[(f"{names[0]} outputs", width)]))
        taken.update(names + [row_name])
    return units
