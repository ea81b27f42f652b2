"""The tensor-parallel plan as a value: ``{module path: Style}``, read from a model or given, checked before any change.

:func:`build_plan` makes the one :class:`TensorParallelPlan` that :func:`~lightning_amp.parallel.convert.convert`
applies, from either source:

* ``plan="auto"``: the units :mod:`~lightning_amp.parallel.reading` finds (known layouts by type and name, attention
  blocks and MLPs by what their forward computes, q/k/v/o names where no forward can be read);
* an explicit plan: this value itself or its dict/JSON form (:meth:`TensorParallelPlan.to_dict`), torch's plan
  dicts (``ColwiseParallel()``, ``RowwiseParallel()``, ``SequenceParallel()``, ``PrepareModuleInput(...)`` of
  ``torch.distributed.tensor.parallel``, as Lightning's and torchtitan's examples write them), or plain styles
  (``"column"``, ``"row"``, ``"replicate"``), keyed by module paths or fnmatch globs (``"layers.*.attention.wq"``);
  a value that is a dict is a plan relative to every module its key matches (a per-block plan given as is). Layers
  that together form a unit ``plan="auto"`` finds get that unit's layout (fused QKV, ``Conv1D``, heads and head
  attributes): the reading completes the plan, and confirms every layout an entry states (a plan printed, edited
  and passed back); other layers pair by parent: a column layer's output stays split when its parent also holds a
  row layer of the plan, else it is gathered.

:func:`build_plan` validates the whole plan *before anything changes*, raising ValueError naming the entry or module
paths and the reason: a glob that matches no module, a style that is not supported (a layer that is no Linear), a
layout the reading does not confirm, a column layer that would feed anything but its row partner (a unit only partly
planned, a row layer without a column partner, a norm or reshape between a named MLP's layers:
:mod:`~lightning_amp.parallel.reading.between`, an explicit column wider than its row partner outside any unit: a
fused projection a contiguous split would cut), heads or features that do not divide by the TP size (key/value
heads: nor divide it), an attention found by structure that cannot be read, an attention ``plan="auto"`` would leave
whole that ``unsplit_ok`` does not accept, or nothing to split (unless ``allow_replicated``).
"""
from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import json
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional, Sequence

from torch import nn

from lightning_amp.parallel.reading.between import between_problem
from lightning_amp.parallel.reading.families import Unit
from lightning_amp.parallel.reading.head_inputs import HeadInput
from lightning_amp.parallel.reading.heads import AttentionShape
from lightning_amp.parallel.reading.qkv_heads import QKVHeads
from lightning_amp.parallel.reading.model_reading import ModelReading, read_model
from lightning_amp.parallel.sequence import SequencePlan, plan_runs

#: column: output features split; row: input features split; replicated: a key/value projection with fewer heads
#: than ranks, whole on every rank (each uses its query heads' one); attention: an ``nn.MultiheadAttention``
#: replaced whole, heads split; replicate: left whole on every rank (``reason`` says why)
STYLES = ("column", "row", "replicated", "attention", "replicate")
#: torch's styles (``torch.distributed.tensor.parallel``) -> ours; the others say only where activations are
#: sharded (tp_fused places them itself: ``sequence_parallel``), so their modules' weights stay whole
_TORCH_STYLES = {"ColwiseParallel": "column", "RowwiseParallel": "row", "SequenceParallel": "replicate",
                 "PrepareModuleInput": "replicate", "PrepareModuleOutput": "replicate",
                 "PrepareModuleInputOutput": "replicate"}


@dataclass(frozen=True)
class Style:
    """How one module is split, with the attributes the split needs.

    ``unit``: the path of the unit's first layer (layers split together share it; ``""``: none given, layers pair
    by parent). ``chunks``: a column's output is that many equal blocks, each split (``[gate | up]``: 2; GPT-2's
    ``c_attn``: 3). ``heads``/``kv_heads``/``head_size``: a fused ``[q | k | v]`` column split by heads, or a
    replicated key/value projection (``kv_heads`` of ``head_size``). ``transposed``: a weight stored ``[in, out]``
    (``Conv1D``). On the unit's first entry, the unit's own: ``attention`` (its heads: ``n_head``, ``n_kv``,
    ``head_size``, ``v_size``, ``layout``, ``groups``), ``head_owner`` (the module whose head-count attributes are
    divided by the TP size), ``config_owner`` (litgpt: the module given a per-rank copy of its ``config``),
    ``per_rank`` (``"module.path:attr"`` -> the value one rank's forward needs, at the TP size it was read for),
    ``partial_grads`` (params between its columns and rows: gradients summed over the TP group), ``head_inputs``
    (per attention module path, the inputs of its forward cut to each rank's heads, an ALiBi bias: ``[{"name": ...,
    "folded": ...}]``, ``folded``: the batch and the heads folded batch first in its third-to-last dimension).
    """

    style: str
    unit: str = ""
    family: str = ""
    found_by: str = ""
    chunks: int = 1
    heads: int = 0
    kv_heads: int = 0
    head_size: int = 0
    transposed: bool = False
    attention: Optional[dict] = None
    head_owner: Optional[str] = None
    config_owner: Optional[str] = None
    per_rank: dict = field(default_factory=dict)
    partial_grads: tuple = ()
    head_inputs: dict = field(default_factory=dict)
    reason: str = ""

    def to_dict(self) -> dict:
        """The fields that differ from their defaults, JSON-ready."""
        values = {name: getattr(self, name) for name in _DEFAULTS}
        return {name: list(value) if isinstance(value, tuple) else value for name, value in values.items()
                if name == "style" or value != _DEFAULTS[name]}

    @classmethod
    def from_dict(cls, entry: str, data: Mapping) -> "Style":
        """ValueError naming ``entry`` for an unknown field or style, TypeError for a field of the wrong type."""
        unknown = sorted(set(data) - set(_DEFAULTS))
        if unknown or "style" not in data:
            raise ValueError(f"plan entry {entry!r}: " + (f"unknown field(s) {unknown}" if unknown else "no 'style'")
                             + f"; a style's fields are {sorted(_DEFAULTS)}")
        _check_style(entry, data["style"])
        kinds = {"chunks": int, "heads": int, "kv_heads": int, "head_size": int, "transposed": bool,
                 "attention": (dict, type(None)), "per_rank": dict, "partial_grads": (list, tuple), "head_inputs": dict}
        for name, kind in kinds.items():
            if name in data and (not isinstance(data[name], kind) or (kind is int and isinstance(data[name], bool))):
                raise TypeError(f"plan entry {entry!r}: {name} must be {getattr(kind, '__name__', kind)}, "
                                f"got {data[name]!r}")
        for path, inputs in data.get("head_inputs", {}).items():
            if not isinstance(inputs, (list, tuple)) or not all(
                    isinstance(i, Mapping) and set(i) == {"name", "folded"} and isinstance(i["name"], str)
                    and isinstance(i["folded"], bool) for i in inputs):
                raise TypeError(f"plan entry {entry!r}: head_inputs[{path!r}] must be a list of "
                                f"{{'name': str, 'folded': bool}}, got {inputs!r}")
        values = dict(data)
        values["partial_grads"] = tuple(values.get("partial_grads", ()))
        return cls(**values)

    def bare(self) -> bool:
        """Whether only the style is given (nothing for the reading to confirm)."""
        return self == Style(self.style)


#: each field of a Style and its default (what :meth:`Style.to_dict` leaves out)
_DEFAULTS = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
             for f in dataclasses.fields(Style)}


def _check_style(entry: str, style: Any) -> None:
    if style not in STYLES:
        raise ValueError(f"plan entry {entry!r}: {style!r} must be one of {STYLES} (or torch's "
                         f"{', '.join(sorted(_TORCH_STYLES))})")


def _torch_style(entry: str, style: Any) -> Style:
    """Ours for torch's ParallelStyle ``style``; ValueError naming ``entry`` for one tp_fused does not support."""
    name = type(style).__name__
    module = type(style).__module__ or ""
    if name not in _TORCH_STYLES or not module.startswith("torch.distributed"):
        raise ValueError(f"plan entry {entry!r}: {name} is not a style tp_fused supports: give "
                         f"{', '.join(sorted(_TORCH_STYLES))} (torch.distributed.tensor.parallel), or one of {STYLES}")
    kind = _TORCH_STYLES[name]
    reason = "" if kind != "replicate" else (f"{name} in the plan: where activations are sharded; tp_fused places "
                                             "the sequence split itself (sequence_parallel=True)")
    return Style(kind, reason=reason)


class TensorParallelPlan(Mapping):
    """``{module path or glob: Style}``: what :func:`build_plan` reads and checks and
    :func:`~lightning_amp.parallel.convert.convert` applies; ``strategy.plan`` after setup.

    Prints as the plan report (:meth:`format`), round-trips through :meth:`to_dict` / :meth:`to_json` (and YAML: the
    dict holds only str, int, bool, lists and dicts), and is accepted by ``plan=`` in any of those forms.
    ``tensor_parallel_size``: the TP size it was read for (None for a plan not yet read). ``sequence``: the
    :class:`~lightning_amp.parallel.sequence.SequencePlan` of a plan checked with ``sequence_parallel=True`` (derived
    from the entries and the model: not part of the dict form, and not compared).
    """

    def __init__(self, entries: Mapping[str, Style], tensor_parallel_size: Optional[int] = None) -> None:
        self._entries = dict(entries)
        self.tensor_parallel_size = tensor_parallel_size
        self.sequence: Optional[SequencePlan] = None  # where sequence parallelism splits the sequence (when checked so)

    def __getitem__(self, path: str) -> Style:
        return self._entries[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorParallelPlan) and self._entries == other._entries

    def __repr__(self) -> str:
        return f"TensorParallelPlan({self.to_dict()!r})"

    def __str__(self) -> str:
        return self.format()

    # ------------------------------------------------------------------ forms
    @classmethod
    def parse(cls, plan: Any) -> "TensorParallelPlan":
        """The plan of ``plan``: this class, its dict or JSON form, torch's plan dicts, plain styles; a dict value
        is a plan relative to every module its key matches. ValueError/TypeError naming the entry."""
        if isinstance(plan, TensorParallelPlan):
            return plan
        if isinstance(plan, str) and plan.lstrip().startswith("{"):
            plan = json.loads(plan)
        if not isinstance(plan, Mapping):
            raise TypeError("plan must be 'auto' or a dict {module path or glob: style}, its JSON, or a TensorParallelPlan "
                            f"(a style: 'column' | 'row' | 'replicate', torch's ColwiseParallel() ..., or a dict), got {plan!r}")
        return cls(dict(_flatten(plan, "")))

    @classmethod
    def from_json(cls, text: str) -> "TensorParallelPlan":
        return cls.parse(json.loads(text))

    def to_dict(self) -> dict:
        """``{module path: {"style": ..., attributes}}``: JSON- and YAML-ready, accepted by ``plan=``."""
        return {path: style.to_dict() for path, style in self._entries.items()}

    def to_json(self, indent: Optional[int] = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    # ------------------------------------------------------------------ units, as the reading and conversion use them
    @classmethod
    def from_units(cls, units: Sequence[Unit], whole: Mapping[str, str], tp: int) -> "TensorParallelPlan":
        """The plan of ``units`` (each layer's entry; the unit's own attributes on its first) and of the layers left
        whole with their reasons."""
        entries: dict[str, Style] = {}
        for unit in units:
            key = unit.members[0]
            for path in unit.members:
                entries[path] = _layer_style(unit, path, key)
            shape = unit.attention_shape
            entries[key] = dataclasses.replace(
                entries[key], attention=dataclasses.asdict(shape) if shape is not None else None, head_owner=unit.heads,
                config_owner=unit.head_config, partial_grads=tuple(unit.partial_grads),
                per_rank={f"{path}:{'.'.join(names)}": value for (path, names), value in unit.head_values.items()},
                head_inputs={path: [dataclasses.asdict(i) for i in inputs] for path, inputs in unit.head_inputs.items()})
        entries.update({path: Style("replicate", reason=why) for path, why in whole.items()})
        return cls(entries, tp)

    @property
    def units(self) -> list[Unit]:
        """The units of the split entries, in plan order (entries without a unit: one unit per parent)."""
        units: dict[str, Unit] = {}
        for path, style in self._entries.items():
            if style.style == "replicate":
                continue
            key = style.unit or "~" + path.rpartition(".")[0]
            unit = units.setdefault(key, Unit(style.family or "explicit", found_by=style.found_by or "plan"))
            if style.style == "attention":
                unit.attention = path
            elif style.style == "row":
                unit.rows.append(path)
            else:
                unit.columns.append(path)
            if style.transposed:
                unit.transposed.add(path)
            if style.chunks > 1:
                unit.chunks[path] = style.chunks
            if style.style == "replicated":
                unit.replicated_heads[path] = (style.kv_heads, style.head_size)
            elif style.heads:
                unit.qkv_heads[path] = QKVHeads(style.heads, style.kv_heads, style.head_size)
            if style.attention is not None:
                unit.attention_shape = AttentionShape(**style.attention)
            unit.heads = style.head_owner if style.head_owner is not None else unit.heads
            unit.head_config = style.config_owner if style.config_owner is not None else unit.head_config
            unit.partial_grads += list(style.partial_grads)
            for where, value in style.per_rank.items():
                owner, _, names = where.rpartition(":")
                unit.head_values[(owner, tuple(names.split(".")))] = value
            unit.head_inputs.update({path: tuple(HeadInput(**i) for i in inputs)
                                     for path, inputs in style.head_inputs.items()})
        return list(units.values())

    @property
    def whole(self) -> dict[str, str]:
        """Per layer left whole, why."""
        return {path: style.reason for path, style in self._entries.items() if style.style == "replicate"}

    @property
    def decisions(self) -> dict[str, str]:
        """Per split layer, its kind for the layers around it: "column" (a replicated key/value projection too),
        "row" or "attention"."""
        kinds = {"replicated": "column"}
        return {path: kinds.get(s.style, s.style) for path, s in self._entries.items() if s.style != "replicate"}

    # ------------------------------------------------------------------ the report
    def format(self) -> str:
        """The plan as the report of a setup prints it: each unit, its layers and heads, what stays whole and why."""
        tp = self.tensor_parallel_size
        units = self.units
        lines = [f"tp_fused plan" + (f" at tensor_parallel_size={tp}" if tp else "") + f": {len(units)} unit(s) "
                 f"split, {len(self.whole)} layer(s) left whole"]
        width = max((len(p) for p in self.decisions), default=0)
        for unit in units:
            shape = unit.attention_shape
            heads = f": {shape.describe(tp)}" if shape is not None and tp else ""
            lines.append(f"  {unit.family} (found by {unit.found_by}){heads}")
            for path in unit.members:
                lines.append(f"    {path:<{width}}  {self[path].style:<10} {_detail(self[path])}".rstrip())
            if unit.head_values:
                lines.append("    per rank: " + ", ".join(f"{'.'.join(filter(None, (o, *n)))} -> {v}"
                                                         for (o, n), v in unit.head_values.items()))
            if unit.heads is not None and unit.rows:
                lines.append(f"    head-count attributes of {unit.heads or 'the model'} (where it has them) divided by the TP size")
            if unit.head_config is not None:
                lines.append(f"    {unit.head_config}.config: a per-rank copy with this rank's head counts")
            for path, inputs in unit.head_inputs.items():
                names = ", ".join(i.name + (" (batch * heads)" if i.folded else "") for i in inputs)
                lines.append(f"    {path or 'the model'}: input(s) {names} cut to each rank's heads")
        if self.sequence is not None:
            lines.append("  sequence parallel:")
            lines += [f"    {line}" for line in self.sequence.describe()]
        if self.whole:
            lines.append("  left whole:")
            lines += [f"    {path}: {why}" for path, why in self.whole.items()]
        return "\n".join(lines)


def _detail(style: Style) -> str:
    if style.style == "replicated":
        return f"{style.kv_heads} key/value head(s) of {style.head_size}, whole on every rank"
    parts = [f"[q | k | v] {style.heads} query / {style.kv_heads} key/value heads of {style.head_size}"] if style.heads else []
    parts += [f"{style.chunks} blocks, each split"] if style.chunks > 1 else []
    parts += ["weight [in, out]"] if style.transposed else []
    return ", ".join(parts)


def _layer_style(unit: Unit, path: str, key: str) -> Style:
    common = dict(unit=key, family=unit.family, found_by=unit.found_by, transposed=path in unit.transposed)
    if path == unit.attention:
        return Style("attention", **common)
    if path in unit.rows:
        return Style("row", **common)
    if path in unit.replicated_heads:
        kv_heads, head_size = unit.replicated_heads[path]
        return Style("replicated", kv_heads=kv_heads, head_size=head_size, **common)
    heads = unit.qkv_heads.get(path)
    counts = dict(heads=heads.n_head, kv_heads=heads.n_query_groups, head_size=heads.head_size) if heads else {}
    return Style("column", chunks=unit.chunks.get(path, 1), **counts, **common)


def _flatten(plan: Mapping, prefix: str) -> Iterator[tuple[str, Style]]:
    for key, value in plan.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"plan entry {key!r}: a key must be a module path or glob (a non-empty str)")
        entry = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Style):
            yield entry, value
        elif isinstance(value, str):
            _check_style(entry, value)
            yield entry, Style(value)
        elif isinstance(value, Mapping) and "style" in value and not isinstance(value["style"], Mapping):
            yield entry, Style.from_dict(entry, value)
        elif isinstance(value, Mapping):  # a plan relative to every module ``key`` matches (a per-block plan)
            yield from _flatten(value, entry)
        else:
            yield entry, _torch_style(entry, value)


def _explicit_decisions(reading: ModelReading, plan: TensorParallelPlan) -> dict[str, str]:
    """Per module path an entry of ``plan`` names (globs expanded), its kind: "column", "row" or "attention"."""
    decisions: dict[str, str] = {}
    names = list(reading.layers)
    for pattern in plan:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            close = difflib.get_close_matches(pattern, names, n=3)
            raise ValueError(f"plan entry {pattern!r} matches no module of {reading.model_name}"
                             + (f" (close: {close})" if close else f" (its modules are named like {names[:3]})"))
    kinds = plan.decisions
    for name, layer in reading.layers.items():
        for pattern, kind in kinds.items():
            if fnmatch.fnmatchcase(name, pattern):
                if not layer.splits:
                    raise ValueError(f"plan entry {pattern!r}: {name!r} is a {layer.type_name}; tp_fused splits "
                                     "nn.Linear, Conv1D and nn.MultiheadAttention only (a vocabulary-parallel "
                                     "embedding or a split norm is not supported): leave it out of the plan and it "
                                     "stays whole on every rank")
                if kind == "attention" and layer.kind != "attention":
                    raise ValueError(f"plan entry {pattern!r}: {name!r} is a {layer.type_name}; the style 'attention' "
                                     "is an nn.MultiheadAttention's (a projection is 'column' or 'row')")
                decisions[name] = "attention" if layer.kind == "attention" else kind
    return decisions


def _unit_kinds(unit: Unit) -> dict[str, str]:
    kinds = {unit.attention: "attention"} if unit.attention else {}
    kinds.update({c: "column" for c in unit.columns})
    kinds.update({r: "row" for r in unit.rows})
    return kinds


def _explicit_units(reading: ModelReading, decisions: dict[str, str]) -> list[Unit]:
    """Explicit layers grouped into units: the units ``plan="auto"`` finds when complete (their heads and layout;
    every ``nn.MultiheadAttention`` is one), else column/row by parent."""
    units, left = [], dict(decisions)
    for unit in reading.units:
        kinds = _unit_kinds(unit)
        named = {n: k for n, k in kinds.items() if n in decisions}
        if not named or (named != kinds and all(decisions[n] == "column" for n in named)):
            continue  # lone column layers gather their outputs (paired by parent below)
        if named != kinds or any(decisions[n] != k for n, k in kinds.items()):
            others = sorted(f"{n} ({k})" for n, k in kinds.items() if decisions.get(n) != k)
            raise ValueError(f"tp_fused plan: {sorted(named)} belong to a {unit.family} unit whose other layers "
                             f"are not planned as they must be: {others}; their outputs would feed layers that "
                             "expect the full tensor. Plan the whole unit or none of it.")
        units.append(unit)
        for n in kinds:
            left.pop(n)
    by_parent: dict[str, Unit] = {}
    for name, kind in left.items():
        parent = name.rpartition(".")[0]
        unit = by_parent.setdefault(parent, Unit("explicit", heads=parent))
        (unit.columns if kind == "column" else unit.rows).append(name)
        if reading.layers[name].kind == "conv1d":
            unit.transposed.add(name)
    for parent, unit in by_parent.items():
        if unit.rows and not unit.columns:
            raise ValueError(f"tp_fused plan: row-parallel {unit.rows} in {parent or 'the model'!r} have no "
                             "column-parallel partner in the same parent, so their input would not be split")
        if not unit.rows:  # lone column layers gather their outputs: nothing downstream sees a shard
            unit.heads = None
        unit.problem = _fused_column(reading, unit)
        units.append(unit)
    return units


def _fused_column(reading: ModelReading, unit: Unit) -> Optional[str]:
    """Why an explicit column/row pair outside any known family would be cut wrongly, or None: a column
    layer with more outputs than its row partner takes is a fused projection (``[q | k | v]``,
    ``[gate | up]``) whose output is split into blocks before the row layer, and a contiguous split of
    its rows would give each rank whole blocks of one kind and none of another."""
    if not unit.rows:
        return None  # gathered outputs: the whole fused tensor is put back together
    widest = max(reading.layers[r].in_features for r in unit.rows)
    for column in unit.columns:
        width = reading.layers[column].out_features
        if width > widest:
            return (f"{column} has {width} outputs but {', '.join(unit.rows)} take(s) {widest} inputs: a fused "
                    "projection (e.g. [q | k | v] or [gate | up]) that a contiguous split would cut across its blocks, "
                    "no family this plan knows says how to split it by heads. Split it into one Linear per block, or "
                    "leave it out of the plan")
    return None


def build_plan(module: nn.Module, plan: Any, tp: int, sequence_parallel: bool = False, allow_replicated: bool = False,
               unsplit_ok: Sequence[str] = (), sequence_dim: Optional[int] = None) -> TensorParallelPlan:
    """The checked plan of ``module`` at TP size ``tp`` for ``plan``: :func:`check_plan` of its
    :func:`~lightning_amp.parallel.reading.model_reading.read_model`; changes nothing."""
    return check_plan(read_model(module, tp), plan, sequence_parallel, allow_replicated, unsplit_ok, sequence_dim)


def check_plan(reading: ModelReading, plan: Any, sequence_parallel: bool = False, allow_replicated: bool = False,
               unsplit_ok: Sequence[str] = (), sequence_dim: Optional[int] = None) -> TensorParallelPlan:
    """The checked plan of the model ``reading`` read, at its TP size, for ``plan`` (``"auto"`` or any form
    :meth:`TensorParallelPlan.parse` takes). Raises ValueError naming the entries or module paths and the reason (see
    the module docstring); ``unsplit_ok``: globs of attentions ``plan="auto"`` may leave whole
    (:mod:`~lightning_amp.parallel.reading.unsplit`). ``sequence_parallel``: the plan's :attr:`TensorParallelPlan.sequence`
    is placed too (:func:`~lightning_amp.parallel.sequence.plan_runs`, ``sequence_dim`` for blocks other than
    ``nn.Transformer*Layer``). Decided on ``reading`` alone, but for the data flow between an explicit plan's own column
    and row layers and the blocks sequence parallelism splits, read from the model last."""
    given = None if plan == "auto" else TensorParallelPlan.parse(plan)
    unsplit_ok = validate_unsplit_ok(unsplit_ok)
    tp, layers = reading.tp, reading.layers
    problems = [f"unsplit_ok: {glob!r} matches no module of {reading.model_name}"
                for glob in unsplit_ok if not any(fnmatch.fnmatchcase(name, glob) for name in layers)]
    if given is None:
        units, whole = list(reading.units), dict(reading.whole)
        if tp > 1:
            units = _accept_unsplit(units, whole, unsplit_ok)
            if units or not allow_replicated:  # allow_replicated with nothing split: every layer whole on purpose
                problems += _unsplit_problems(reading, whole, unsplit_ok)
    else:
        units = _explicit_units(reading, _explicit_decisions(reading, given))
        planned = {m for u in units for m in u.members}
        reasons = given.whole
        whole = {name: reasons.get(name) or "not named by the plan" for name, layer in layers.items()
                 if layer.projection and name not in planned}
    for unit in units:
        if unit.problem:
            problems.append(f"{', '.join(unit.members)} ({unit.family}): {unit.problem}")
            continue
        sizes = list(unit.divisible)
        sizes += [(f"{c}.out_features", layers[c].out_features // unit.chunks.get(c, 1)) for c in unit.columns
                  if c not in unit.qkv_heads and c not in unit.replicated_heads]
        sizes += [(f"{r}.in_features", layers[r].in_features) for r in unit.rows]
        bad = [f"{what}={value}" for what, value in sizes if value < tp or value % tp]
        if bad:
            problems.append(f"{', '.join(unit.members)} ({unit.family}): {'; '.join(bad)} not divisible by "
                            f"tensor_parallel_size={tp}")
        if sequence_parallel and (unit.chunks or unit.transposed or len({n.rpartition('.')[0] for n in unit.columns + unit.rows}) > 1):
            problems.append(f"{', '.join(unit.members)} ({unit.family}): sequence_parallel=True is supported for "
                            "nn.MultiheadAttention and for column/row layers in one parent module only")
    _refuse(problems)
    if not units and tp > 1 and not allow_replicated:
        raise ValueError(
            f"tp_fused: no layer of {reading.model_name} can be split across {tp} ranks (no nn.MultiheadAttention, "
            "attention product between its projections or column -> elementwise -> row MLP found); every rank would train "
            "the whole model. Pass plan={'glob.of.names': 'column'|'row'} to choose layers, or "
            "TensorParallelStrategy(allow_replicated=True) to train replicated on purpose."
            + "".join(f"\n  {name}: {why}" for name, why in list(whole.items())[:8]))
    result = TensorParallelPlan.from_units(units, whole, tp)
    if given is not None:
        _confirm(reading, given, result)
        _refuse([f"{', '.join(u.members)} ({u.family}): {problem}" for u in units if u.family == "explicit"
                 and (problem := _explicit_flow(reading, u))])
    if sequence_parallel:
        result.sequence = plan_runs(reading.model, result.units, result.decisions, sequence_dim)
    return result


def _refuse(problems: list[str]) -> None:
    if problems:
        raise ValueError("tp_fused: the plan cannot be applied (nothing was changed):\n  " + "\n  ".join(problems)
                         + "\nChoose a tensor_parallel_size that divides them, pass plan={'glob': 'column'|'row'|"
                         "'replicate'} to pick the layers to split, or unsplit_ok=['glob.of.attention'] to keep an "
                         "attention whole on every rank on purpose.")


def _confirm(reading: ModelReading, given: TensorParallelPlan, found: TensorParallelPlan) -> None:
    """ValueError naming the entry when a field it states (a style, a layout, heads, per-rank values) differs from
    what the reading of the model finds for a layer it matches."""
    for pattern, style in given.items():
        stated = {k: v for k, v in style.to_dict().items() if k != "reason"}
        if style.style == "replicate" or style.bare():
            continue
        for path in (p for p in found if fnmatch.fnmatchcase(p, pattern)):
            read = found[path].to_dict()
            differ = {k: v for k, v in stated.items() if read.get(k, _DEFAULTS[k]) != v}
            if differ:
                raise ValueError(
                    f"plan entry {pattern!r}: the plan states {differ}, reading {reading.model_name} finds "
                    f"{ {k: read.get(k, _DEFAULTS[k]) for k in differ} }: a layout the reading cannot confirm (per-rank "
                    "values hold for the tensor_parallel_size the plan was read at). Give the layer's style alone "
                    "('column' | 'row') to take the layout the reading finds, or leave it out of the plan")


def accepted(path: str, unsplit_ok: Sequence[str]) -> Optional[str]:
    """The first glob of ``unsplit_ok`` that matches ``path`` or a module above it, or None."""
    parts = path.split(".")
    prefixes = [".".join(parts[:end]) for end in range(len(parts), 0, -1)]
    return next((glob for glob in unsplit_ok if any(fnmatch.fnmatchcase(p, glob) for p in prefixes)), None)


def _accept_unsplit(units: list[Unit], whole: dict[str, str], unsplit_ok: Sequence[str]) -> list[Unit]:
    """``units`` but those that cannot be split and that ``unsplit_ok`` accepts, whose layers go to ``whole``."""
    kept = []
    for unit in units:
        globs = {accepted(member, unsplit_ok) for member in unit.members}
        if unit.problem is None or None in globs:
            kept.append(unit)
            continue
        for member in unit.members:
            whole[member] = f"left whole as unsplit_ok={accepted(member, unsplit_ok)!r} allows: {unit.problem}"
    return kept


def _unsplit_problems(reading: ModelReading, whole: dict[str, str], unsplit_ok: Sequence[str]) -> list[str]:
    """One line per attention module with a projection in ``whole`` (path -> why it is left whole) that no glob of
    ``unsplit_ok`` accepts; the accepted ones get their reason in ``whole`` (updated in place)."""
    owners: dict[str, list[str]] = {}
    for path in whole:
        if path in reading.attention_of:
            owners.setdefault(reading.attention_of[path], []).append(path)
    problems = []
    for owner, paths in owners.items():
        seen = reading.whole_attentions[owner]
        glob = accepted(owner, unsplit_ok)
        if glob is not None:
            for path in paths:
                whole[path] = f"attention {owner} left whole as unsplit_ok={glob!r} allows: {seen.reason}"
            continue
        problems.append(f"{reading.model_name}: the attention {owner} ({seen.type_name}) would be left whole on every "
                        f"rank ({', '.join(paths)}): {seen.reason}. {seen.way_out}")
    return problems


def _explicit_flow(reading: ModelReading, unit: Unit) -> Optional[str]:
    """Why the data between an explicit unit's columns and rows (one parent) is not theirs to split (a norm over the
    split features: :func:`~lightning_amp.parallel.reading.between.between_problem`, untraced), or None."""
    if not (unit.columns and unit.rows):
        return None
    return between_problem(reading.model, unit.columns, unit.rows, reading.layers[unit.columns[0]].out_features,
                           trace=False)


def validate_unsplit_ok(globs: Sequence[str]) -> tuple[str, ...]:
    """``globs`` as a tuple; TypeError unless a list, tuple or set of str, ValueError naming an empty glob."""
    if isinstance(globs, str) or not isinstance(globs, (list, tuple, set, frozenset)) or \
            not all(isinstance(g, str) for g in globs):
        raise TypeError(f"unsplit_ok must be a list of module path globs (str), e.g. "
                        f"['transformer.h.*.self_attention'], got {globs!r}")
    empty = [g for g in globs if not g.strip()]
    if empty:
        raise ValueError(f"unsplit_ok: {empty[0]!r} is not a module path glob (an empty glob would match nothing)")
    return tuple(sorted(globs)) if isinstance(globs, (set, frozenset)) else tuple(globs)


