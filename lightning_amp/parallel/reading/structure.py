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

The graph is walked once per reading (:func:`~lightning_amp.parallel.reading.dataflow.read_flows`); this module decides
units from what that walk shows, and the heads of the attentions found are read last. Projections found in neither are
left whole, each with the reason (:attr:`StructuralPlan.whole`). An attention
whose heads cannot be split is a :class:`~lightning_amp.parallel.reading.families.Unit` with its ``problem`` set: the plan
refuses it by name.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from torch import nn

from lightning_amp.parallel.reading.dataflow import Flows, read_flows
from lightning_amp.parallel.reading.families import Unit
from lightning_amp.parallel.reading.forward_graph import ForwardUnreadable, read_forward
from lightning_amp.parallel.reading.heads import attention_unit
from lightning_amp.parallel.reading.projections import Layer


@dataclass
class StructuralPlan:
    """What :func:`find_structural_units` found: the units and, per projection left whole, why."""

    units: list[Unit] = field(default_factory=list)
    whole: dict[str, str] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)  # module path -> fx's reason
    seen: set = field(default_factory=set)  # projections some reading showed


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _to_read(path: str, module: nn.Module, layers: Mapping[str, Layer], claimed: set) -> tuple[list[str], int]:
    """The projections under the module ``path`` (a container of layers, not one) that are not ``claimed``, and the
    width of its first input, guessed as the input width its projections share most ([] when it is not read)."""
    if (path in layers and layers[path].splits) or (
            module.__module__.startswith("torch.nn") and not isinstance(module, (nn.Sequential, nn.ModuleList,
                                                                                 nn.ModuleDict))):
        return [], 0
    inside = [p for p, layer in layers.items() if layer.projection and (not path or p.startswith(path + "."))]
    widths = collections.Counter(layers[p].in_features for p in inside)
    return [p for p in inside if p not in claimed], (widths.most_common(1)[0][0] if widths else 0)


def find_structural_units(model: nn.Module, claimed: Iterable[str], tp: int, layers: Mapping[str, Layer]) -> StructuralPlan:
    """Units of the projections of ``model`` not in ``claimed`` (module paths), found by structure (see the module
    docstring); ``tp``: the tensor-parallel size their head counts must split over; ``layers``: the model's
    :func:`~lightning_amp.parallel.reading.projections.layer_table`. Modules are read parents first; a module whose
    reading leaves two or more of its projections unexplained (a branch the reading took, such as a KV cache, hid
    them) is read itself, and the reason a projection is left whole comes from the innermost reading."""
    claimed = set(claimed)
    found = StructuralPlan()
    notes: dict[str, str] = {}  # why a projection is left whole; readings go parents first: the innermost one's stands
    layouts: dict[str, str] = {}  # an attention's projections in a layout the plan does not split: that is why
    attentions: list[tuple[list[str], str]] = []  # (query/key/value projections, out-projection): heads read last
    for path, module in model.named_modules():  # parents first; a child is read when its parent left it unexplained
        free, hidden = _to_read(path, module, layers, claimed)
        if len(free) < 2:
            continue
        try:
            graph = read_forward(module, hidden)
        except ForwardUnreadable as error:
            found.unreadable[path] = str(error)
            continue
        flows = read_flows(graph, path)
        found.seen.update(_join(path, target) for target in flows.layers)
        attentions += _attentions(path, flows, claimed, layouts)
        found.units += _mlps(path, flows, claimed, notes, layers, tp)
    for path, layer in layers.items():
        if layer.projection and path not in claimed:
            found.whole[path] = layouts.get(path) or notes.get(path) or _unread_reason(path, found.unreadable, layers)
    cache: dict = {}  # attentions of one class and attribute values are read once
    found.units += [attention_unit(model, members, out, tp, layers, cache) for members, out in attentions]
    return found


def _unread_reason(path: str, unreadable: dict[str, str], layers: Mapping[str, Layer]) -> str:
    """Why the projection ``path``, which no reading showed, is left whole."""
    owners = [p for p in unreadable if p == "" or path.startswith(p + ".")]
    if not owners:
        return "no other layer of its module: nothing to pair it with"
    owner = max(owners, key=len)
    where, fx_reason = owner or "the model", unreadable[owner][:120]
    siblings = [p for p, layer in layers.items() if layer.projection and p.rpartition(".")[0] == owner]
    if siblings == [path]:  # the only layer of the unread module itself: its other layers lie in its sub-modules
        return (f"the only layer of {where} outside its sub-modules, so nothing to pair it with (a vocabulary head or a "
                f"classifier stays whole); torch.fx cannot read the forward of {where} ({fx_reason})")
    return f"torch.fx cannot read the forward of {where} ({fx_reason}) and no known layout names it"


def _attentions(base: str, flows: Flows, claimed: set, layouts: dict[str, str]) -> list[tuple[list[str], str]]:
    """The attentions of one reading not yet claimed, as (query/key/value projections, out-projection); claims them."""
    found = []
    for attention in flows.attentions:
        names = [_join(base, t) for t in (*attention.qkv, *attention.outputs)]
        if claimed.intersection(names) or len(attention.outputs) != 1:
            continue
        if len(set(attention.qkv)) == 2:  # key and value fused, query apart (or the like)
            for name in names:
                layouts[name] = ("an attention whose query, key and value come from two projections (one fused for two "
                               "of them): not a layout tp_fused splits")
            continue
        found.append((list(dict.fromkeys(_join(base, t) for t in attention.qkv)), _join(base, attention.outputs[0])))
    for members, out in found:
        claimed.update(members + [out])
    return found


def _mlps(base: str, flows: Flows, claimed: set, notes: dict[str, str], layers: Mapping[str, Layer],
          tp: int) -> list[Unit]:
    """The MLPs of one reading (column -> elementwise -> row) among projections not yet claimed; claims them."""
    units: list[Unit] = []
    for target in flows.layers:
        name = _join(base, target)
        flow = flows.flows[target]
        if name in claimed:
            continue
        if flow.blocker is not None:
            notes[name] = (f"its output leaves {base or 'the model'} with no layer after it to take a shard (a "
                           "vocabulary head or a classifier stays whole)" if flow.blocker.startswith("the output of ")
                           else f"its output goes through {flow.blocker}, not an elementwise op, before any other layer")
            continue
        if flow.row is None:
            notes[name] = "its output feeds " + (", ".join(_join(base, t) for t in flow.reached) or "no other layer")
            continue
        row_name = _join(base, flow.row)
        names = [_join(base, c) for c in flow.columns]
        if row_name in claimed or claimed.intersection(names) or not flow.clean or target not in flow.columns \
                or flow.foreign is not None:
            notes[name] = f"{row_name} also reads {flow.foreign or 'the output of another layer'}, not only " \
                          "elementwise functions of its output"
            continue
        width = layers[row_name].in_features
        cuts = {_join(base, c): k for c, k in flow.cuts.items()}
        if any(layers[n].out_features != width * cuts[n] for n in names):
            notes[name] = f"its width differs from what {row_name} takes"
            continue
        if width % tp:
            notes[name] = (f"an MLP with {row_name}, but its {width} features do not divide by "
                           f"tensor_parallel_size={tp}")
            continue
        transposed = {n for n in names + [row_name] if layers[n].kind == "conv1d"}
        units.append(Unit("MLP", names, [row_name], transposed=transposed, found_by="structure",
                          chunks={n: k for n, k in cuts.items() if k > 1}, divisible=[(f"{names[0]} outputs", width)]))
        claimed.update(names + [row_name])
    return units
