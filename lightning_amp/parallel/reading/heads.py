"""The heads of an attention found by structure: how many, how its projections lay them out, and which attributes
its forward reads for its reshapes, with the values one tensor-parallel rank needs.

:func:`attention_unit` reads the *owner* of the projections (the innermost module holding them all) with its first
input shaped ``(2, 5, hidden)``:

* the **head size** is the last dimension of the query at the attention product; the **head counts** are the
  projections' widths divided by it (a fused ``[q | k | v]`` projection: the widths of the blocks its ``split`` or
  ``chunk`` returns, or of its ``(..., 3, heads, head_size)`` view). The product's inputs must hold the heads in
  their third-to-last dimension (``(batch, heads, sequence, head_size)``, as ``F.scaled_dot_product_attention``
  takes them);
* the query heads are split over the ranks; the key/value heads are split too when their count divides by the TP
  size, else replicated when it divides the TP size (Megatron's GQA/MQA layout: every rank keeps the key/value head
  its query heads use); any other count is a ``problem`` naming the counts;
* the **attributes**: every int attribute of the owner and of the modules and plain objects (a ``config``) under it
  that reaches the arguments of an op on the way to the out-projection is a candidate. A candidate whose value is a
  head count or width (``n_heads``, ``n_kv_heads``, ``n_rep``, ``n_heads * head_size``, ...) may have to take that
  count's per-rank value; combinations of candidates are tried, the fewest changed attributes first, by reading the
  owner again as one rank would run it (its projections at their per-rank widths, the attributes at the tried
  values; once as it is and once with each optional input given, as a mask) and the combination under which every
  reading's query, key and value reach the product with the per-rank head counts, and the out-projection gets its
  per-rank width, is kept (two of the fewest changes that differ: ambiguous, refused). None: a ``problem`` (a head
  count written as a literal, a per-head tensor, a view that mixes heads) that names the module and the counts.
* **params used between** the projections and the out-projection (a norm over each head's features) see one rank's
  heads only: the unit lists them so that their gradients are summed over the TP group.
"""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.fx as fx
from torch import nn

from lightning_amp.parallel.reading.families import Unit
from lightning_amp.parallel.reading.dataflow import ForwardGraph, _elementwise, heads_at, products, reach, sources
from lightning_amp.parallel.reading.forward_graph import ForwardUnreadable, Key, optional_inputs, read_forward, tags_of
from lightning_amp.parallel.reading.projections import Layer, is_projection, widths_of
from lightning_amp.parallel.reading.head_inputs import find_head_inputs
from lightning_amp.parallel.reading.qkv_heads import QKVHeads

_MAX_TRIES = 256  # attribute combinations read at most per attention
_SPLIT_METHODS = frozenset({"split", "chunk", "tensor_split"})


@dataclass(frozen=True)
class AttentionShape:
    """The heads of one attention: ``n_head`` query heads and ``n_kv`` key/value heads of ``head_size`` (values of
    ``v_size``); ``layout``: "separate" (three projections), "blocks" (a fused ``[q | k | v]``), "chunks" (a fused
    projection viewed ``(..., 3, heads, head_size)``) or "groups" (a fused projection viewed ``(..., groups, ...)``:
    ``groups`` equal runs of features, each holding the query, key and value heads of one key/value group or one
    head, interleaved: GPT-NeoX, BLOOM, Falcon's new decoder architecture; a rank keeps whole groups, a contiguous
    run of features)."""

    n_head: int
    n_kv: int
    head_size: int
    v_size: int
    layout: str
    groups: int = 0

    def problem(self, tp: int) -> Optional[str]:
        if self.layout == "groups" and self.groups % tp:
            return (f"{self.groups} interleaved groups of query, key and value heads not divisible by "
                    f"tensor_parallel_size={tp} (each rank keeps whole groups)")
        if self.n_head % tp:
            return f"{self.n_head} query heads not divisible by tensor_parallel_size={tp}"
        if self.n_kv % tp and tp % self.n_kv:
            return (f"{self.n_kv} key/value heads neither divisible by tensor_parallel_size={tp} nor dividing it (each "
                    f"rank's {self.n_head // tp} query heads cannot get whole key/value heads, split or replicated)")
        if self.n_kv % tp and self.layout == "chunks":
            return f"{self.n_kv} key/value heads of a fused (..., 3, heads, head_size) projection cannot be replicated"
        return None

    def replicated(self, tp: int) -> bool:
        return self.n_kv % tp != 0

    def local_kv(self, tp: int) -> int:
        return 1 if self.replicated(tp) else self.n_kv // tp

    def describe(self, tp: int) -> str:
        kv = (f"{self.n_kv} key/value head(s) replicated, 1 used per rank" if self.replicated(tp) else
              f"{self.n_kv} key/value heads, {self.n_kv // tp} per rank")
        return f"{self.n_head} query heads of {self.head_size}, {self.n_head // tp} per rank; {kv}"


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _common_owner(paths: list[str]) -> str:
    parts = [p.split(".")[:-1] for p in paths]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


@dataclass
class _Outcome:
    """What the reading of one owner found (paths and keys relative to the owner), and the int attributes its forward
    read with their values (an owner of the same class, layers and read values has the same outcome)."""

    shape: Optional[AttentionShape] = None
    problem: Optional[str] = None
    values: Optional[dict] = None
    partial: tuple = ()
    read: Optional[dict] = None
    head_inputs: tuple = ()


def attention_unit(model: nn.Module, members: list[str], out: str, tp: int, layers: Mapping[str, Layer],
                   cache: Optional[dict] = None) -> Unit:
    """The unit of an attention whose projections are ``members`` (q, k, v or one fused) and ``out`` (module paths
    in ``model``), with its heads, layout and attribute values at TP size ``tp``, or its ``problem``. ``layers``: the
    model's :func:`~lightning_amp.parallel.reading.projections.layer_table`. ``cache``: a
    dict kept across the calls of one plan (the layers of a model are read once per class and attribute values)."""
    owner_path = _common_owner(members + [out])
    owner = model.get_submodule(owner_path) if owner_path else model
    local = [m[len(owner_path) + 1:] if owner_path else m for m in members]
    out_local = out[len(owner_path) + 1:] if owner_path else out
    unit = Unit("attention", list(members), [out], found_by="structure")
    unit.transposed = {p for p in members + [out] if layers[p].kind == "conv1d"}
    outcome = _cached(owner, local, out_local, tp, {} if cache is None else cache)
    where = owner_path or type(model).__name__
    shape = unit.attention_shape = outcome.shape
    if shape is None:
        unit.problem = f"the heads of {where} cannot be read: {outcome.problem}"
        return unit
    if outcome.problem:
        unit.problem = f"{where} ({shape.describe(tp)}): {outcome.problem}"
        return unit
    if shape.layout == "blocks":
        if members[0] in unit.transposed and shape.replicated(tp):
            unit.problem = f"{where} ({shape.describe(tp)}): a Conv1D [in, out] projection's key/value heads cannot be replicated"
            return unit
        unit.qkv_heads = {members[0]: QKVHeads(shape.n_head, shape.n_kv, shape.head_size)}
    elif shape.layout == "chunks":
        unit.chunks = {members[0]: 3}
    elif shape.replicated(tp):
        unit.replicated_heads = {members[1]: (shape.n_kv, shape.head_size), members[2]: (shape.n_kv, shape.v_size)}
    unit.head_values = {(_join(owner_path, path), names): value for (path, names), value in outcome.values.items()}
    unit.partial_grads = [_join(owner_path, p) for p in outcome.partial]
    unit.head_inputs = {owner_path: outcome.head_inputs} if outcome.head_inputs else {}
    return unit


def _cached(owner: nn.Module, members: list[str], out: str, tp: int, cache: dict) -> _Outcome:
    static = (type(owner), tuple(members), out, tp,
              tuple((p, widths_of(m)) for p, m in owner.named_modules() if is_projection(m)))
    for outcome in cache.get(static, []):
        if all(_value_of(owner, key) == value for key, value in outcome.read.items()):
            return outcome
    outcome = _analyse(owner, members, out, tp)
    cache.setdefault(static, []).append(outcome)
    return outcome


def _analyse(owner: nn.Module, members: list[str], out: str, tp: int) -> _Outcome:
    try:
        reading = _Reading(owner, members, out)
    except _Unsplittable as error:
        return _Outcome(problem=str(error), read={})
    outcome = _Outcome(reading.shape, reading.shape.problem(tp), read=reading.read_values())
    if outcome.problem is None and reading.shape.layout == "blocks" and reading.shape.v_size != reading.shape.head_size:
        outcome.problem = f"a fused projection with values of {reading.shape.v_size} != head size {reading.shape.head_size}"
    if outcome.problem is None:
        try:
            outcome.values = reading.solve(tp)
        except _Unsplittable as error:
            outcome.problem = str(error)
        outcome.partial = tuple(reading.used_between())
        outcome.head_inputs, problem = find_head_inputs(reading.graph, reading.product, reading.shape.n_head)
        outcome.problem = outcome.problem or problem
    return outcome


class _Unsplittable(Exception):
    pass


class _Reading:
    """The owner's forward read once as it is; :meth:`solve` reads it again as one rank would run it."""

    def __init__(self, owner: nn.Module, members: list[str], out: str) -> None:
        self.owner, self.members, self.out = owner, members, out
        self.hidden = widths_of(owner.get_submodule(members[0]))[0]
        try:
            self.graph = read_forward(owner, self.hidden)
        except ForwardUnreadable as error:
            raise _Unsplittable(f"torch.fx cannot read its forward ({error})") from None
        self.product = _find(self.graph, members, out)
        if self.product is None:
            raise _Unsplittable("reading it alone does not show the attention product between its projections")
        shapes = [self.graph.shape(a) for a in self.product[:3]]
        if any(s is None or len(s) < 3 for s in shapes):
            raise _Unsplittable("the shapes of the query, key and value at the attention product are not known")
        self.head_size, self.v_size = shapes[0][-1], shapes[2][-1]
        self._check_before_heads()
        self.shape = self._shape()
        # the forward read again with each optional input given (a mask takes another branch, e.g. repeat_kv):
        # every reading that still shows this attention must run as one rank too
        self.readings = {(): self.graph}
        signatures = {_signature(self.graph)}
        for name in optional_inputs(owner):
            try:
                graph = read_forward(owner, self.hidden, unknown=[name])
            except ForwardUnreadable:
                continue
            found = _find(graph, members, out)
            if found is None or any(graph.shape(a) is None for a in found[:3]):
                continue  # a branch that hides this attention or its shapes (a KV cache given): nothing to check
            if _signature(graph) not in signatures:
                signatures.add(_signature(graph))
                self.readings[(name,)] = graph
        self.at_product = {}  # per reading, the head counts the product sees (after a repeat_kv)
        for given, graph in self.readings.items():
            seen = [graph.shape(a) for a in _find(graph, members, out)[:3]]
            if any(s is None or len(s) < 3 for s in seen):
                raise _Unsplittable("the shapes of the query, key and value at the attention product are not known")
            self.at_product[given] = [heads_at(s) for s in seen]
            if heads_at(seen[0]) != self.shape.n_head:
                raise _Unsplittable(f"the query reaches the attention product with {heads_at(seen[0])} in its heads "
                                    f"dimension, not its {self.shape.n_head} heads")
            for name, count in zip(("key", "value"), self.at_product[given][1:]):
                if count not in (self.shape.n_head, self.shape.n_kv):
                    raise _Unsplittable(f"the {name} reaches the attention product with {count} heads, neither the "
                                        f"{self.shape.n_head} query heads nor its {self.shape.n_kv} heads")

    # ------------------------------------------------------------------ the layout
    def _layer(self, path: str) -> nn.Module:
        return self.owner.get_submodule(path)

    def _node(self, path: str) -> fx.Node:
        return next(n for n in self.graph.graph.nodes if n.op == "call_module" and n.target == path)

    def _first_reshape(self, start: fx.Node) -> fx.Node:
        """The first op after ``start`` (a projection) that is not elementwise (its output used once on the way), or
        the node whose uses are all indexing (``qkv[..., :q_end]``, ``qkv[..., q_end:k_end]``, ...: Phi-3)."""
        node = start
        while True:
            users = [user for user in node.users if not _reads_metadata(user, node)]
            if len(users) > 1 and all(_indexes(user) for user in users):
                return node
            if len(users) != 1:
                raise _Unsplittable(f"the output of {start.target} is used {len(users)} times before it is split "
                                    "into heads")
            node = users[0]
            if not (node.op in ("call_function", "call_method") and _elementwise(self.graph.module, node)):
                return node

    def _check_before_heads(self) -> None:
        for path in dict.fromkeys(self.members):
            node = self._first_reshape(self._node(path))
            if not (_indexed(node) or node.op in ("call_function", "call_method") and (
                    node.target in ("view", "reshape", "unflatten", "split", "chunk", "tensor_split")
                    or node.target in (torch.reshape, torch.split, torch.chunk))):
                raise _Unsplittable(f"{_describe(node)} acts on the whole output of {path} before it is split into "
                                    "heads (only elementwise ops may)")

    def _shape(self) -> AttentionShape:
        d, dv = self.head_size, self.v_size
        if len(set(self.members)) == 3:
            q, k, v = (widths_of(self._layer(p))[1] for p in self.members)
            if q % d or k % d or v % dv or k // d != v // dv:
                raise _Unsplittable(f"projection widths {q}, {k}, {v} are not whole heads of {d}")
            return AttentionShape(q // d, k // d, d, dv, "separate")
        fused = self._node(self.members[0])
        split = self._first_reshape(fused)
        width = widths_of(self._layer(self.members[0]))[1]
        value = self.graph.value(split)
        if _indexed(split) and (self.graph.shape(split) or (0,))[-1] == width:
            return self._sliced(split, width, width)
        if split.target in _SPLIT_METHODS and isinstance(value, (tuple, list)) and len(value) == 3:
            blocks = [t.shape[-1] for t in value]
            if sum(blocks) != width or blocks[0] % d or blocks[1] % d or blocks[2] % dv:
                raise _Unsplittable(f"{self.members[0]} splits into blocks {blocks}, not whole heads of {d}")
            order = [self._block_of(split, i) for i in range(3)]
            if order != ["q", "k", "v"]:
                raise _Unsplittable(f"{self.members[0]} holds its blocks in the order {order}, not [q | k | v]")
            return AttentionShape(blocks[0] // d, blocks[1] // d, d, dv, "blocks")
        shape = self.graph.shape(split)
        if shape is not None and len(shape) >= 3 and tuple(shape[-3:]) == (3, width // (3 * d), d) and d == dv:
            if shape[-2] == 3:
                raise _Unsplittable(f"{self.members[0]} is viewed (..., 3, 3, {d}): three blocks of three heads or "
                                    "three heads of [q | k | v] interleaved, the view alone cannot tell")
            return AttentionShape(shape[-2], shape[-2], d, d, "chunks")
        lead = self.graph.shape(fused)
        if shape is not None and lead is not None and tuple(shape[:len(lead) - 1]) == tuple(lead[:-1]) \
                and split.target in ("view", "reshape", torch.reshape, "unflatten"):
            trailing = tuple(shape[len(lead) - 1:])
            if len(trailing) == 2 and trailing[1] == d and _indexed(split):  # (..., heads, d), then sliced
                return self._sliced(split, trailing[0], width, unit=d)
            if len(trailing) >= 2 and d == dv and trailing[0] != 3:  # (..., 3, rest): blocks of q, k, v or 3 groups?
                return self._groups(trailing[0], width)
        raise _Unsplittable(f"cannot tell how {self.members[0]} is split into query, key and value "
                            f"({_describe(split)} of its output)")

    def _sliced(self, node: fx.Node, extent: int, width: int, unit: int = 1) -> AttentionShape:
        """The shape of a fused projection of ``width`` outputs whose output ``node`` (``extent`` entries of ``unit``
        features in its last indexed dimension) is cut into ``[q | k | v]`` by three indexings
        (``qkv[..., a:b]``, or ``heads[..., [-2], :]`` of a view into heads: Falcon's multi-query layout)."""
        d, dv = self.head_size, self.v_size
        cuts = []
        for user in node.users:
            if _indexes(user):
                span = _span(user.args[1], extent, axis=-1 if unit == 1 else -2)
                if span is None:
                    raise _Unsplittable(f"{self.members[0]}'s output is indexed by {user.args[1]!r}, not one run of "
                                        "its features")
                cuts.append((span, self._role(user)))
        cuts.sort()
        spans = [span for span, _ in cuts]
        if len(cuts) != 3 or spans[0][0] != 0 or spans[-1][1] != extent or any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
            raise _Unsplittable(f"{self.members[0]}'s output is cut into {spans}, not three runs covering its {extent}")
        if [role for _, role in cuts] != ["q", "k", "v"]:
            raise _Unsplittable(f"{self.members[0]} holds its blocks in the order {[r for _, r in cuts]}, not [q | k | v]")
        blocks = [(b - a) * unit for a, b in spans]
        if blocks[0] % d or blocks[1] % d or blocks[2] % dv or sum(blocks) != width:
            raise _Unsplittable(f"{self.members[0]} is cut into blocks {blocks}, not whole heads of {d}")
        return AttentionShape(blocks[0] // d, blocks[1] // d, d, dv, "blocks")

    def _groups(self, groups: int, width: int) -> AttentionShape:
        """A fused projection viewed ``(..., groups, ...)``: each group holds its query heads and key/value heads (see
        :class:`AttentionShape`); the head counts come from the query at the product and the width."""
        d = self.head_size
        n_head = heads_at(self.graph.shape(self.product[0]))
        n_kv, odd = divmod(width // d - n_head, 2)
        if width % (groups * d) or odd or n_kv < 1 or n_head % groups or n_kv % groups:
            raise _Unsplittable(f"{self.members[0]} is viewed as {groups} groups of {width // groups} features, not "
                                f"whole query ({n_head}) and key/value heads of {d} per group")
        return AttentionShape(n_head, n_kv, d, d, "groups", groups)

    def _role(self, node: fx.Node) -> str:
        q, k, v, _ = self.product
        return next((name for name, arg in zip("qkv", (q, k, v)) if arg is node or node in _ancestors(arg)), "?")

    def _block_of(self, split: fx.Node, index: int) -> str:
        user = next((u for u in split.users if u.target is operator.getitem and u.args[1] == index), None)
        return "?" if user is None else self._role(user)

    def read_values(self) -> dict:
        """Every int attribute some reading's ops read, with its value."""
        keys = set()
        for graph in self.readings.values():
            for node in graph.graph.nodes:
                keys |= tags_of((node.args, node.kwargs))
        return {key: _value_of(self.graph.module, key) for key in keys}

    def used_between(self) -> list[str]:
        """Modules with params, and params, the forward uses between the projections and the out-projection (a norm
        over each head's features): paths relative to the owner."""
        used = []
        for node in sorted(self._region(self.graph, self.product), key=lambda n: n.name):
            if node.op == "call_module" and node.target not in self.members and node.target != self.out:
                if any(True for _ in self.owner.get_submodule(node.target).parameters()):
                    used.append(node.target)
            elif node.op == "get_attr" and node.target in dict(self.owner.named_parameters()):
                used.append(node.target)
        return list(dict.fromkeys(used))

    # ------------------------------------------------------------------ the attributes
    def _region(self, graph: ForwardGraph, product) -> set:
        starts = [n for n in graph.graph.nodes if n.op == "call_module" and n.target in set(self.members)]
        ends = [n for n in graph.graph.nodes if n.op == "call_module" and n.target == self.out]
        after = reach(starts, lambda n: n.users)
        before = reach(ends, lambda n: n.all_input_nodes) | set(ends)
        return (after & before) | set(ends)

    def _local_widths(self, tp: int) -> dict[str, tuple[int, int]]:
        shape, widths = self.shape, {}
        if shape.layout == "separate":
            q, k, v = self.members
            kv = shape.local_kv(tp)
            widths[q] = (self.hidden, shape.n_head // tp * shape.head_size)
            widths[k] = (widths_of(self._layer(k))[0], kv * shape.head_size)
            widths[v] = (widths_of(self._layer(v))[0], kv * shape.v_size)
        else:
            kv = shape.local_kv(tp)
            widths[self.members[0]] = (self.hidden, shape.n_head // tp * shape.head_size + kv * (shape.head_size + shape.v_size))
        o_in, o_out = widths_of(self._layer(self.out))
        widths[self.out] = (o_in // tp, o_out)
        return widths

    def _targets(self, tp: int) -> dict[int, set]:
        """Per head count or width of this attention, the per-rank values it may have to take."""
        s = self.shape
        kv = s.local_kv(tp)
        pairs = [(s.n_head, s.n_head // tp), (s.n_kv, kv), (s.n_head // s.n_kv, (s.n_head // tp) // kv),
                 (s.n_head * s.head_size, s.n_head // tp * s.head_size), (s.n_kv * s.head_size, kv * s.head_size),
                 (s.n_head * s.v_size, s.n_head // tp * s.v_size), (s.n_kv * s.v_size, kv * s.v_size)]
        targets: dict[int, set] = {}
        for value, local in pairs:
            if value != local:
                targets.setdefault(value, {value}).add(local)
        return targets

    def solve(self, tp: int) -> dict[Key, int]:
        """The attribute values (by key, relative to the owner) one rank's forward needs; raises
        :class:`_Unsplittable` when no combination of candidates makes the forward produce per-rank shapes."""
        keys = set()
        for graph in self.readings.values():
            ends = [n for n in graph.graph.nodes if n.op == "call_module" and n.target == self.out]
            for node in reach(ends, lambda n: n.all_input_nodes) | set(ends):  # what the out-projection's input needs
                keys |= tags_of((node.args, node.kwargs))
        current = {key: _value_of(self.graph.module, key) for key in keys}
        targets = self._targets(tp)
        options = {key: sorted(targets[value], key=lambda v: v != value) for key, value in current.items()
                   if value in targets}
        names = sorted(options)
        combos = list(itertools.product(*(options[k] for k in names)))
        if len(combos) > _MAX_TRIES:
            raise _Unsplittable(f"{len(names)} attributes hold head counts ({_keys(names)}): too many combinations")
        widths = self._local_widths(tp)
        changes = [{k: v for k, v in zip(names, combo) if v != current[k]} for combo in combos]
        changes.sort(key=len)  # the fewest changed attributes first; all of the first size that works are compared
        good, problems = [], {}
        for changed in changes:
            if good and len(changed) > len(good[0]):
                break
            problem = next(filter(None, (self._runs_as_rank(widths, changed, given, tp) for given in self.readings)),
                           None)
            if problem is None:
                good.append(changed)
            problems[tuple(sorted(changed.items()))] = problem
        if not good:
            if len(changes) == 1:
                raise _Unsplittable(problems[()])
            most = max(problems, key=len)  # every candidate at a per-rank value: what goes wrong then
            tried = ", ".join(f"{_key(k)}={v}" for k, v in most)
            raise _Unsplittable(f"{self._no_solution(names, current)}; with {tried}: {problems[most]}")
        if any(g != good[0] for g in good[1:]):
            raise _Unsplittable(f"its attributes {_keys(names)} can take the per-rank head counts in more than one way")
        return good[0]

    def _expected(self, given: tuple, tp: int) -> list[int]:
        s, kv = self.shape, self.shape.local_kv(tp)
        return [s.n_head // tp] + [s.n_head // tp if seen == s.n_head else kv for seen in self.at_product[given][1:]]

    def _runs_as_rank(self, widths, values, given: tuple, tp: int) -> Optional[str]:
        """Why the forward (with the optional inputs ``given``) read as one rank would run it does not produce one
        rank's shapes with the attribute ``values``, or None."""
        expected = self._expected(given, tp)
        try:
            graph = read_forward(self.owner, self.hidden, widths=widths, values=values, unknown=given)
        except ForwardUnreadable as error:
            return f"read as one rank, its forward fails ({error})"
        product = _find(graph, self.members, self.out)
        if product is None:
            return "read as one rank, the attention product is gone"
        region = self._region(graph, product)
        errors = [n for n in region if n in graph.errors]
        if errors:
            return f"read as one rank, {_describe(errors[0])} fails: {graph.errors[errors[0]]}"
        shapes = [graph.shape(a) for a in product[:3]]
        if any(s is None or len(s) < 3 for s in shapes):
            return "read as one rank, the shapes at the attention product are not known"
        seen = [heads_at(s) for s in shapes]
        if seen != expected:
            return (f"read as one rank, the query, key and value reach the attention product with {seen} heads, "
                    f"not {expected}")
        out = next(n for n in graph.graph.nodes if n.op == "call_module" and n.target == self.out)
        if out in graph.errors or graph.shape(out.args[0]) is None:
            return f"read as one rank, {self.out} does not get its per-rank input"
        return None

    def _no_solution(self, names, current) -> str:
        listed = ", ".join(f"{_key(k)}={current[k]}" for k in names) or "none"
        return (f"no per-rank value of the attributes its forward reads for its reshapes ({listed}) gives one rank's "
                "heads their shapes (a head count written as a literal, a per-head tensor, or a view across heads?)")


def _indexes(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem and not isinstance(node.args[1], int)


def _indexed(node: fx.Node) -> bool:
    """Whether ``node``'s value is cut by indexing only: two or more uses, each an index (``x[..., a:b]``)."""
    users = list(node.users)
    return len(users) > 1 and all(_indexes(user) for user in users)


def _span(index, extent: int, axis: int) -> Optional[tuple[int, int]]:
    """The run ``[start, stop)`` an index (``(..., slice)``, ``(..., slice, slice(None))``, a one-element list) takes
    of the dimension ``axis`` (-1 or -2) of ``extent`` entries, the others whole; None for anything else."""
    parts = list(index) if isinstance(index, tuple) else [index]
    if Ellipsis not in parts:
        return None
    after = parts[parts.index(Ellipsis) + 1:]
    before = parts[:parts.index(Ellipsis)]
    if any(p != slice(None) for p in before) or len(after) != -axis or any(p != slice(None) for p in after[1:]):
        return None
    part = after[0]
    if isinstance(part, list) and len(part) == 1 and isinstance(part[0], int):
        start = part[0] % extent
        return start, start + 1
    if isinstance(part, slice) and part.step in (None, 1):
        start, stop, _ = part.indices(extent)
        return (start, stop) if stop > start else None
    return None


def _find(graph: ForwardGraph, members: list[str], out: str):
    for q, k, v, result in products(graph):
        layers = [next(iter(s)).target if len(s) == 1 else None for s in (sources(graph, a) for a in (q, k, v))]
        if layers == (members if len(members) == 3 else members * 3):
            return q, k, v, result
    return None


def _signature(graph: ForwardGraph) -> tuple:
    return tuple((n.op, str(n.target)) for n in graph.graph.nodes)


def _ancestors(node: fx.Node) -> set:
    return reach([node], lambda n: n.all_input_nodes)


def _value_of(root: nn.Module, key: Key) -> int:
    path, names = key
    owner = root.get_submodule(path) if path else root
    for name in names:
        owner = vars(owner)[name] if name in vars(owner) else getattr(owner, name)
    return int(owner)


def _key(key: Key) -> str:
    path, names = key
    return ".".join([path] + list(names)) if path else ".".join(names)


def _keys(keys) -> str:
    return ", ".join(_key(k) for k in keys)


def _describe(node: fx.Node) -> str:
    if node.op == "call_module":
        return f"{node.target}"
    if node.op == "output":
        return "the module's output"
    return f"{getattr(node.target, '__name__', node.target)}"


_METADATA_ATTRIBUTES = frozenset({"shape", "dtype", "device", "ndim", "is_cuda"})
_METADATA_METHODS = frozenset({"size", "dim", "numel", "dtype", "is_floating_point", "is_contiguous"})


def _reads_metadata(user: fx.Node, node: fx.Node) -> bool:
    """Whether ``user`` reads only ``node``'s shape, dtype or device (``t.shape[-1] // head_dim``, ``t.size(0)``):
    no use of its data, so it does not keep the output from being split into heads."""
    if user.op == "call_function" and user.target is getattr and user.args[0] is node:
        return user.args[1] in _METADATA_ATTRIBUTES
    return user.op == "call_method" and user.target in _METADATA_METHODS and user.args[0] is node
