"""What a module's forward computes, read with ``torch.fx`` without running it on data.

:func:`read_forward` traces ``module.forward`` symbolically into a :class:`ForwardGraph`: the ops from the inputs
to the outputs, with the layers that hold weights (``nn.Linear``, ``transformers``' ``Conv1D``, every module of
``torch.nn``) as single nodes. The tensor-parallel plan reads it to find attention blocks and MLPs by what they
compute (:mod:`~lightning_amp.parallel.reading.structure`). Three things go beyond a plain ``torch.fx.symbolic_trace``:

* **shapes**: the first positional input is given a shape, ``(2, 5, hidden)``, and every op whose inputs are known
  is run on ``meta`` tensors (no memory, no data), so code that reads shapes (``x.shape[:-1]``, ``B, T, C =
  x.size()``, ``if q.shape[2] > 1``) is followed as it would run. Inputs other than the first are unknown; an
  elementwise op of a known and an unknown tensor keeps the known one's shape (rotary tables broadcast that way),
  and an op with unknown keyword arguments (an attention mask) is run without them. A branch on an unknown value
  is read as not taken; a parameter with a default (``input_pos=None``, ``use_cache=False``) keeps it.
* **where integers come from**: every ``int`` attribute of the module and of its submodules and their plain
  attribute objects (a ``config`` read as ``self.config.n_head``) is read as an ``int`` subclass that remembers its
  key (:data:`Key`) and keeps it through arithmetic, so a reshape's arguments say which attributes gave them.
* **other values**: ``values={key: int}`` and ``widths={layer path: (in, out)}`` read the forward as it would run
  with those attribute values and layer widths (those of one tensor-parallel rank), on private shallow copies
  (of the modules, their plain objects and their lists, dicts and sets): the module, its parameters and its
  attributes are never written, and the random number generator is left as it was.

``forward`` methods wrapped by decorators (``functools.wraps``, as ``transformers`` does) are read unwrapped.
:class:`ForwardUnreadable` says why a forward cannot be read (fx's own reason).

The projections it keeps as single nodes are :mod:`~lightning_amp.parallel.reading.projections`'; the graph it makes,
the ops that act elementwise and the walks along its data are :mod:`~lightning_amp.parallel.reading.dataflow`'s.

The walks along a graph's data (which projections a value comes from, the attention products, where a projection's
output goes) are :mod:`~lightning_amp.parallel.reading.dataflow`'s. The first input is read with ``batch = 2``
(:data:`READ_BATCH`), so heads folded into the batch can be told apart there.
"""
from __future__ import annotations

import bisect
import copy
import dis
import inspect
import operator
import types
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.fx.proxy import Attribute, Proxy, TraceError

from lightning_amp.parallel.reading.dataflow import _UNKNOWN, READ_BATCH, ForwardGraph
from lightning_amp.parallel.reading.projections import is_projection, widths_of

#: an attribute that holds an int: (module path relative to the read module, attribute names from that module);
#: ``("blocks.0.attn", ("n_heads",))`` or, through a plain object, ``("attn", ("config", "n_head"))``
Key = tuple[str, tuple[str, ...]]

_BATCH, _SEQ = READ_BATCH, 5  # the shape given to the first input: (batch, sequence, hidden)
#: what a required input is read as when the forward cannot be read without knowing its shape (``len(bias.shape)``):
#: an additive bias broadcast over everything, as MPT's ALiBi ``position_bias`` is checked to be (3 dimensions)
_BROADCAST_BIAS = (1, 1, 1)
_GIVEN = ("<the required inputs given as broadcast biases>",)  # a reading attempt
_ELEMENTWISE_BINARY = frozenset({operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.sub,
                                 torch.mul, torch.div, "add", "sub", "mul", "div", "add_", "mul_", "sub_", "div_"})


class ForwardUnreadable(Exception):
    """The forward cannot be read symbolically (the message is fx's reason)."""


class Tagged(int):
    """An ``int`` read from attributes (``keys``), kept through ``+ - * // %`` with other ints."""

    keys: frozenset

    def __new__(cls, value: int, keys: Iterable[Key]) -> "Tagged":
        obj = super().__new__(cls, value)
        obj.keys = frozenset(keys)
        return obj


def _tagged_op(op, reverse: bool = False):
    def method(self, other):
        if isinstance(other, bool) or not isinstance(other, int):
            return NotImplemented
        result = op(int(other), int(self)) if reverse else op(int(self), int(other))
        return Tagged(result, self.keys | getattr(other, "keys", frozenset()))
    return method


for _name, _op in (("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
                   ("floordiv", operator.floordiv), ("mod", operator.mod)):
    setattr(Tagged, f"__{_name}__", _tagged_op(_op))
    setattr(Tagged, f"__r{_name}__", _tagged_op(_op, reverse=True))
Tagged.__neg__ = lambda self: Tagged(-int(self), self.keys)


def tags_of(value: Any) -> frozenset:
    """The keys of every :class:`Tagged` int inside ``value`` (args of a node: tuples, lists, dicts, slices)."""
    if isinstance(value, Tagged):
        return value.keys
    if isinstance(value, (tuple, list)):
        return frozenset().union(*(tags_of(v) for v in value)) if value else frozenset()
    if isinstance(value, dict):
        return tags_of(list(value.values()))
    if isinstance(value, slice):
        return tags_of([value.start, value.stop, value.step])
    return frozenset()


class _ShapeProxy(Proxy):
    """A Proxy whose length and index come from its node's meta value when it is known."""

    def __len__(self) -> int:
        value = self.tracer.known(self.node)
        if isinstance(value, (tuple, list, torch.Size, torch.Tensor)):
            return len(value)
        return super().__len__()

    def __index__(self) -> int:
        value = self.tracer.known(self.node)
        if isinstance(value, int) and not isinstance(value, bool):
            return int(value)
        raise TraceError(f"the value of {self.node.name} is not known while reading the forward")

    def __getattr__(self, name: str):
        return _ShapeAttribute(self, name)


class _ShapeAttribute(Attribute, _ShapeProxy):
    pass


class _Reader(fx.Tracer):
    """fx's tracer with meta values (see the module docstring)."""

    def __init__(self, first_input: Optional[torch.Tensor], widths: Mapping[str, tuple[int, int]],
                 dtype: torch.dtype, given: Mapping[str, torch.Tensor] = None) -> None:
        super().__init__()
        self.first_input, self.widths, self.dtype, self.given = first_input, dict(widths), dtype, dict(given or {})
        self.values: dict = {}
        self.errors: dict = {}
        self._placeholders = 0

    # -- fx hooks (public, backward compatible unless noted in docs/architecture.md)
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return is_projection(m) or super().is_leaf_module(m, qualname)

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        return super().create_args_for_root(inspect.unwrap(root_fn), is_module, concrete_args)

    def proxy(self, node: fx.Node) -> Proxy:
        return _ShapeProxy(node, self)

    def to_bool(self, obj: Proxy) -> bool:
        value = self.known(obj.node)
        if value is not None:
            return bool(value)
        return _asserted(inspect.currentframe())  # unknown: an assert holds, any other branch is not taken

    def iter(self, obj: Proxy):
        value = self.known(obj.node)
        if isinstance(value, (tuple, list, torch.Size)):
            return iter([obj[i] for i in range(len(value))])
        return super().iter(obj)

    def keys(self, obj: Proxy):
        if obj.node.op == "placeholder" and obj.node.target.startswith("**"):
            return []  # ``**kwargs`` passed on: read as empty
        return super().keys(obj)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        self.values[proxy.node] = self._evaluate(proxy.node)
        return proxy

    # -- meta values
    def known(self, node: fx.Node) -> Any:
        value = self.values.get(node, _UNKNOWN)
        return None if value is _UNKNOWN else value

    def _evaluate(self, node: fx.Node) -> Any:
        if node.op == "placeholder":
            self._placeholders += 1
            if self._placeholders > 1 and node.target in self.given:
                return self.given[node.target]
            return self.first_input if self._placeholders == 1 and self.first_input is not None else _UNKNOWN
        if node.op == "get_attr":
            return _to_meta(_resolve(self.root, node.target))
        args, unknown = _materialize(node.args, self.values)
        kwargs, unknown_kw = _materialize(node.kwargs, self.values)
        if unknown:
            return self._partly_known(node, args, kwargs)
        if unknown_kw:  # an optional input the reading does not know (a mask): run without it
            kwargs = {k: v for k, v in kwargs.items() if k not in unknown_kw}
        try:
            return self._run(node, args, kwargs)
        except Exception as error:  # noqa: BLE001 (a shape error of known inputs: remembered, the value unknown)
            if not unknown_kw:
                self.errors[node] = error
            return _UNKNOWN

    def _partly_known(self, node: fx.Node, args: tuple, kwargs: dict) -> Any:
        """An elementwise op of a known activation (3 dims or more: batch, sequence, ...) and an unknown tensor
        keeps the activation's shape (a rotary table broadcasts over it), as ``bias.baddbmm(q, k)`` of an unknown
        bias keeps ``q @ k``'s; a projection of an unknown input (the encoder states of a cross-attention) is read as
        (batch, sequence, its outputs)."""
        if node.op == "call_module":
            module = self.root.get_submodule(node.target)
            if is_projection(module):
                width = self.widths.get(node.target, widths_of(module))[1]
                return torch.empty(_BATCH, _SEQ, width, device="meta", dtype=self.dtype)
            return _UNKNOWN
        if node.target is operator.getitem and isinstance(args[0], torch.Tensor) and len(args) == 2:
            index = _bounds_to_end(args[1], args[0].dim())
            if index is not None:
                try:
                    return args[0][index]
                except Exception:  # noqa: BLE001 (not an index the tensor takes: unknown)
                    return _UNKNOWN
        if node.target in ("baddbmm", torch.baddbmm):
            batches = list(args[1:3]) + [kwargs.get(k) for k in ("batch1", "batch2")][len(args[1:3]):]
            if all(isinstance(b, torch.Tensor) for b in batches):
                return torch.bmm(*batches)
        if node.target in _ELEMENTWISE_BINARY and len(args) == 2:
            known = [a for a in args if isinstance(a, torch.Tensor)]
            if len(known) == 1 and known[0].dim() >= 3:
                return known[0]
        return _UNKNOWN

    def _run(self, node: fx.Node, args: tuple, kwargs: dict) -> Any:
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.op == "call_module":
            module = self.root.get_submodule(node.target)
            if isinstance(module, nn.Embedding) and args[0].is_floating_point():
                # the model's first input read as (batch, sequence, hidden) is token ids (batch, sequence)
                return args[0].new_empty(*args[0].shape[:-1], module.embedding_dim)
            if is_projection(module):
                width_in, width_out = self.widths.get(node.target, widths_of(module))
                x = args[0]
                if x.shape[-1] != width_in:
                    raise ValueError(f"{node.target} takes {width_in} features, gets {x.shape[-1]}")
                return x.new_empty(*x.shape[:-1], width_out)
            if next(module.children(), None) is not None:
                return _UNKNOWN  # its forward would call submodules: not followed
            # called through forward, not __call__, which fx replaces while it traces
            meta = copy.copy(module)
            vars(meta)["_parameters"] = {k: _to_meta(v) for k, v in module._parameters.items()}
            vars(meta)["_buffers"] = {k: _to_meta(v) for k, v in module._buffers.items()}
            return type(module).forward(meta, *args, **kwargs)
        return _UNKNOWN


def _bounds_to_end(index: Any, ndim: int) -> Any:
    """``index`` with each unknown slice bound read as the end of its dimension (``x[..., :u]`` the whole dimension,
    ``x[..., u:]`` none of it: a rotary embedding over ``u`` features, read as over all of them, keeps the shapes
    that follow), or None when anything else in it is unknown."""
    parts = index if isinstance(index, tuple) else (index,)
    fixed = []
    for part in parts:
        if isinstance(part, slice) and _UNKNOWN in (part.start, part.stop, part.step):
            if part.step is _UNKNOWN or part.start is _UNKNOWN and part.stop is not None:
                return None
            part = slice(0, 0) if part.start is _UNKNOWN else slice(part.start, None)
        elif part is _UNKNOWN:
            return None
        fixed.append(part)
    return tuple(fixed) if isinstance(index, tuple) else fixed[0]


def _asserted(frame) -> bool:
    """Whether the branch that asked (user code, two frames up: ``Proxy.__bool__`` calls ``to_bool``) is an
    ``assert``: its jump is followed by ``LOAD_ASSERTION_ERROR`` (CPython's bytecode for ``assert``)."""
    user = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
    if user is None:
        return False
    instructions = list(dis.get_instructions(user.f_code))
    offsets = [i.offset for i in instructions]
    here = bisect.bisect_left(offsets, user.f_lasti)
    return any(i.opname == "LOAD_ASSERTION_ERROR" for i in instructions[here + 1:here + 3])


def _resolve(root: nn.Module, target: str) -> Any:
    """The tensor a ``get_attr`` node names (looked up without ``getattr``, which fx replaces while it traces)."""
    path, _, name = target.rpartition(".")
    owner = root.get_submodule(path) if path else root
    for table in (owner._parameters, owner._buffers, vars(owner)):
        if name in table:
            return table[name]
    return _UNKNOWN


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="meta")
    return value


def _materialize(value: Any, values: dict) -> tuple[Any, set]:
    """``value`` with every node replaced by its meta value; the names (kwargs) or positions of unknown ones."""
    unknown: set = set()

    def swap(v, where):
        if isinstance(v, fx.Node):
            known = values.get(v, _UNKNOWN)
            if known is _UNKNOWN:
                unknown.add(where)
            return known
        if isinstance(v, (tuple, list)):
            return type(v)(swap(x, where) for x in v)
        if isinstance(v, dict):
            return {k: swap(x, where) for k, x in v.items()}
        if isinstance(v, slice):
            return slice(swap(v.start, where), swap(v.stop, where), swap(v.step, where))
        return v

    if isinstance(value, dict):
        return {k: swap(v, k) for k, v in value.items()}, unknown
    return tuple(swap(v, i) for i, v in enumerate(value)), unknown


# ------------------------------------------------------------------------------------------- attribute copies

def _plain_object(value: Any) -> bool:
    """An object whose int fields a forward may read as head counts (a ``config``), not a module, tensor or code."""
    return (hasattr(value, "__dict__") and not isinstance(value, (nn.Module, torch.Tensor, type, types.ModuleType,
                                                                   types.FunctionType, types.MethodType)))


def _private_tree(module: nn.Module, leaf) -> tuple[nn.Module, dict[str, Any]]:
    """Shallow copies of ``module`` and of every module under it that a reading enters (not the leaves), and of
    their plain attribute objects (memoised: a config shared by two modules stays shared); returns the copied root
    and {path or "path:attr": copy} of the objects whose int fields may be set."""
    owners: dict[str, Any] = {}
    objects: dict[int, Any] = {}

    def clone(path: str, sub: nn.Module) -> nn.Module:
        new = copy.copy(sub)
        state = vars(new)
        state["_modules"] = {name: (child if child is None or leaf(child, _join(path, name)) else
                                    clone(_join(path, name), child))
                             for name, child in sub._modules.items()}
        for name, value in list(state.items()):
            if not name.startswith("_") and isinstance(value, (list, dict, set)):
                state[name] = copy.copy(value)  # a forward that appends to a list of its own appends to a copy
            if not name.startswith("_") and _plain_object(value):
                if id(value) not in objects:
                    try:
                        objects[id(value)] = copy.copy(value)
                    except Exception:  # noqa: BLE001 (an object that cannot be copied is read as it is, untagged)
                        continue
                state[name] = objects[id(value)]
                owners[f"{path}:{name}"] = objects[id(value)]
        owners[path] = new
        return new

    return clone("", module), owners


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def int_fields(owners: Mapping[str, Any]) -> dict[Key, int]:
    """Every int attribute of the copied objects, by key."""
    found: dict[Key, int] = {}
    for where, obj in owners.items():
        path, _, attr = where.partition(":")
        for name, value in vars(obj).items():
            if isinstance(value, int) and not isinstance(value, bool):
                found[(path, (attr, name) if attr else (name,))] = value
    return found


def _set(owners: Mapping[str, Any], key: Key, value: int) -> None:
    path, names = key
    owner = owners[f"{path}:{names[0]}"] if len(names) == 2 else owners[path]
    vars(owner)[names[-1]] = value


_WORKED: dict = {}  # (forward function, parameters kept at their default) -> the None defaults read as unknown


def optional_inputs(module: nn.Module) -> list[str]:
    """The parameters of ``module.forward`` after the first whose default is None (masks, caches, positions)."""
    return [name for name, default in _defaults(module).items() if default is None]


def _defaults(module: nn.Module) -> dict[str, Any]:
    parameters = list(inspect.signature(inspect.unwrap(type(module).forward)).parameters.values())[1:]
    return {p.name: p.default for p in parameters[1:]  # the first input is always read, with its shape
            if p.default is not inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def required_inputs(module: nn.Module) -> list[str]:
    """The parameters of ``module.forward`` after the first that have no default."""
    parameters = list(inspect.signature(inspect.unwrap(type(module).forward)).parameters.values())[2:]
    return [p.name for p in parameters
            if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def read_forward(module: nn.Module, hidden: Optional[int] = None, *, widths: Mapping[str, tuple[int, int]] = None,
                 values: Optional[Mapping[Key, int]] = None, unknown: Iterable[str] = (),
                 dtype: torch.dtype = torch.float32) -> ForwardGraph:
    """Read ``module.forward`` (see the module docstring). ``hidden``: the width of the first input (``None``: its
    shape unknown). ``values``: attribute values to read the forward with (default: the module's own), every int
    attribute tagged with its key. ``widths``: per projection path, the (in, out) features to read it with.
    ``unknown``: parameters read as unknown inputs rather than their default (an attention mask given).
    Raises :class:`ForwardUnreadable` naming fx's reason."""
    first = None if hidden is None else torch.empty(_BATCH, _SEQ, hidden, device="meta", dtype=dtype)
    defaults = {k: v for k, v in _defaults(module).items() if k not in set(unknown)}
    optional = [name for name, default in defaults.items() if default is None]
    # defaults kept (input_pos=None: no KV cache); a None that the forward needs (position_embeddings=None)
    # is read as an unknown input instead, one at a time, then all together
    attempts = [()] + [(name,) for name in optional] + ([tuple(optional)] if len(optional) > 1 else [])
    # last, where nothing else reads: the required inputs read as broadcast biases (their shape is asked for)
    required = required_inputs(module)
    attempts += [_GIVEN] if required else []
    memo = (inspect.unwrap(type(module).forward), tuple(sorted(defaults)))
    if _WORKED.get(memo) in attempts:  # what worked for this forward before goes first
        attempts.insert(0, attempts.pop(attempts.index(_WORKED[memo])))
    first_error = None
    for attempt in attempts:
        given = {} if attempt is not _GIVEN else {
            name: torch.empty(_BROADCAST_BIAS, device="meta", dtype=dtype) for name in required}
        unknown = () if attempt is _GIVEN else attempt
        tracer = _Reader(first, widths or {}, dtype, given)
        root, owners = _private_tree(module, lambda m, path: tracer.is_leaf_module(m, path))
        for key, value in int_fields(owners).items():
            _set(owners, key, Tagged(values.get(key, value) if values else value, [key]))
        try:
            with torch.random.fork_rng(devices=[]):  # a forward that draws random numbers for real draws them here
                graph = tracer.trace(root, concrete_args={k: v for k, v in defaults.items() if k not in unknown})
        except Exception as error:  # noqa: BLE001 (whatever the forward raised under tracing is the reason)
            first_error = first_error or error
            continue
        _WORKED[memo] = attempt
        layers = {n: m for n in graph.nodes if n.op == "call_module"
                  and is_projection(m := root.get_submodule(n.target))}
        return ForwardGraph(root, graph, tracer.values, tracer.errors, layers)
    reason = (str(first_error).strip().splitlines() or [""])[0][:200]
    raise ForwardUnreadable(f"{type(first_error).__name__}: {reason}")
