"""The one conversion of a model by its plan, the report of what it became, and checkpoints in the plain layout.

:func:`convert` takes a checked :class:`~lightning_amp.parallel.plan.TensorParallelPlan` (automatic or explicit: one
path) and replaces each planned layer in place by the parallel layer holding this rank's slice of the module's
*current* weights (:mod:`~lightning_amp.parallel.layers`, :mod:`~lightning_amp.parallel.fused_qkv`,
:mod:`~lightning_amp.parallel.attention`), gives the attributes a split attention's forward reads their per-rank values
and its per-head inputs their cut (:mod:`~lightning_amp.parallel.head_input_slicer`), and returns the
:class:`PlanReport`, which the strategies print at setup on rank 0 and keep as ``strategy.plan_report``. :func:`gathered_state_dict` and
:func:`load_gathered_state_dict` move checkpoints between the converted model and the plain layout.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from torch import nn

from lightning_amp.parallel.attention import ParallelMultiheadAttention
from lightning_amp.parallel.config import TensorParallelConfig
from lightning_amp.parallel.fused_qkv import ReplicatedHeadsLinear, ReplicatedKVColumnParallel, fused_qkv_parallel
from lightning_amp.parallel.groups import group_size
from lightning_amp.parallel.head_input_slicer import install_head_inputs
from lightning_amp.parallel.layers import ColumnParallelLinear, RowParallelLinear, share_input
from lightning_amp.parallel.plan import TensorParallelPlan, build_plan
from lightning_amp.parallel.reading.families import HEAD_ATTRS, Unit
from lightning_amp.parallel.reading.heads import AttentionShape
from lightning_amp.parallel.sequence import install_boundaries

_LAYER_OPTIONS = ("gradient_accumulation_fusion", "async_grad_allreduce")  # config fields the layers read
#: the layers a conversion makes (a model holding one is converted already)
PARALLEL_LAYERS = (ParallelMultiheadAttention, ReplicatedKVColumnParallel, ReplicatedHeadsLinear, ColumnParallelLinear,
                   RowParallelLinear)


@dataclass
class Conversion:
    """One layer converted: its path, its class before, its kind ("column" | "row" | "replicated": key/value heads
    kept whole | "attention": ``nn.MultiheadAttention`` | "seq-split") and what each rank holds."""

    name: str
    original: str
    kind: str
    detail: str


@dataclass
class SplitUnit:
    """One unit split: its family, how it was found ("names": a known layout; "structure": read from its forward),
    its heads (attention found by structure), the layers converted and the attributes given per-rank values
    (path -> (before, after))."""

    family: str
    found_by: str
    heads: str = ""
    layers: list[Conversion] = field(default_factory=list)
    attributes: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class PlanReport:
    """What one rank's model became (see the module docstring). ``whole``: per Linear/Conv1D left whole, why."""

    tensor_parallel_size: int
    split: list[SplitUnit] = field(default_factory=list)
    whole: dict[str, str] = field(default_factory=dict)
    sequence: list[Conversion] = field(default_factory=list)

    @property
    def conversions(self) -> list[Conversion]:
        """Every converted layer (and sequence-parallel run), in plan order."""
        return [row for unit in self.split for row in unit.layers] + self.sequence

    def format(self) -> str:
        """The report as text (printed at setup on rank 0)."""
        lines = [f"tp_fused plan at tensor_parallel_size={self.tensor_parallel_size}: {len(self.split)} unit(s) split, "
                 f"{len(self.whole)} layer(s) left whole"]
        width = max((len(r.name) for r in self.conversions), default=0)
        for unit in self.split:
            lines.append(f"  {unit.family} (found by {unit.found_by})" + (f": {unit.heads}" if unit.heads else ""))
            lines += [f"    {r.name:<{width}}  {r.original:<10} {r.kind:<10} {r.detail}" for r in unit.layers]
            if unit.attributes:
                lines.append("    per rank: " + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in unit.attributes.items()))
        if self.sequence:
            lines.append("  sequence parallel:")
            lines += [f"    {r.name}: {r.detail}" for r in self.sequence]
        if self.whole:
            lines.append("  left whole:")
            lines += [f"    {name}: {why}" for name, why in self.whole.items()]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _parent(module: nn.Module, name: str):
    parent_name, _, attr = name.rpartition(".")
    return (module.get_submodule(parent_name) if parent_name else module), attr


def _heads_line(unit: Unit, tp: int) -> str:
    """The unit's heads as the report prints them ("" when the plan names none)."""
    shape = unit.attention_shape
    if shape is None and len(unit.qkv_heads) == 1:  # litgpt's, found by names
        (heads,) = unit.qkv_heads.values()
        shape = AttentionShape(heads.n_head, heads.n_query_groups, heads.head_size, heads.head_size, "blocks")
    return shape.describe(tp) if shape is not None else ""


def _head_values(unit: Unit, tp: int) -> dict[tuple[str, tuple[str, ...]], int]:
    """Per attribute key (owner path, attribute names) the value one rank's attention reads: the reading's
    ``unit.head_values``, and for litgpt (``unit.head_config``) the local head counts in its ``config``."""
    values = dict(unit.head_values)
    if unit.head_config is not None:
        (heads,) = (h.local(tp) for h in unit.qkv_heads.values())
        values[(unit.head_config, ("config", "n_head"))] = heads.n_head
        values[(unit.head_config, ("config", "n_query_groups"))] = heads.n_query_groups
    return values


def _set_head_values(module: nn.Module, values: dict[tuple[str, tuple[str, ...]], int]) -> dict[str, tuple[int, int]]:
    """Give the attributes an attention's forward reads (``values``, see :func:`_head_values`) the values one rank
    needs: a module's own attribute is set on it; a field of a plain object (a ``config``, maybe shared with the whole
    model) is set on a per-rank shallow copy (it keeps what ``__post_init__`` derived) that every module under the
    owners holding that object gets. Returns {attribute path: (before, after)}."""
    changed, copies = {}, {}
    for (path, names), value in sorted(values.items()):
        owner = module.get_submodule(path) if path else module
        label = ".".join([path, *names]) if path else ".".join(names)
        if len(names) == 1:
            changed[label] = (getattr(owner, names[0]), value)
            setattr(owner, names[0], value)
            continue
        shared = getattr(owner, names[0])
        if id(shared) not in copies:
            copies[id(shared)] = (shared, copy.copy(shared))
        original, private = copies[id(shared)]
        changed[label] = (getattr(original, names[1]), value)
        vars(private)[names[1]] = value
    for original, private in copies.values():
        for path in {path for path, _ in values}:
            for sub in (module.get_submodule(path) if path else module).modules():
                for attr, held in list(vars(sub).items()):
                    if held is original:
                        setattr(sub, attr, private)
    return changed


def _divide_head_counts(module: nn.Module, unit: Unit, tp: int) -> None:
    """Divide the head counts (:data:`~lightning_amp.parallel.reading.families.HEAD_ATTRS`) of the module the plan
    names as the unit's ``heads`` by ``tp`` (a unit found by names with row partners: its forward splits by them)."""
    if unit.heads is None or not unit.rows:
        return
    owner = module.get_submodule(unit.heads) if unit.heads else module
    for attr in HEAD_ATTRS:
        value = getattr(owner, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(owner, attr, value // tp)


def _mark_partial_grads(module: nn.Module, unit: Unit) -> None:
    """Params used between the unit's columns and rows see this rank's heads only: their gradients are summed over
    the TP group. The mark is the ``sequence_parallel`` attribute that
    :class:`~lightning_amp.parallel.main_grad.MainGradBuffer` reads."""
    for path in unit.partial_grads:
        try:
            params = list(module.get_submodule(path).parameters())
        except AttributeError:  # a parameter's path
            params = [module.get_parameter(path)]
        for p in params:
            p.sequence_parallel = True


def _convert_unit(module: nn.Module, unit: Unit, group: Any, sp_kwargs: dict, linear_kwargs: dict) -> list[Conversion]:
    """Replace every layer ``unit`` plans (its ``nn.MultiheadAttention``, then its columns and rows) by the parallel
    layer :func:`_parallel_layer` builds, and give its columns one input collective
    (:func:`~lightning_amp.parallel.layers.share_input`); returns their report rows."""
    rows = []
    for name in unit.members:
        parent, attr = _parent(module, name)
        child = getattr(parent, attr)
        new, kind, detail = _parallel_layer(child, name, unit, group, dict(sp_kwargs.get(name, {}), **linear_kwargs))
        setattr(parent, attr, new)
        rows.append(Conversion(name, type(child).__name__, kind, detail))
    share_input([module.get_submodule(name) for name in unit.columns], group)
    return rows


def _parallel_layer(child: nn.Module, name: str, unit: Unit, group: Any, extra: dict) -> tuple[nn.Module, str, str]:
    """The one reading of a plan entry: this rank's parallel layer for ``child`` (module path ``name`` of ``unit``),
    built from its current weights, with its kind and report detail (see :class:`Conversion`). ``extra``: the
    layer's sequence-parallel and layer options. A path of ``unit.replicated_heads`` / ``unit.qkv_heads`` is never
    in the other (:func:`~lightning_amp.parallel.plan.build_plan` fills one per entry)."""
    if name == unit.attention:
        new = ParallelMultiheadAttention(child, group, **extra)
        return new, "attention", f"{child.num_heads} heads -> {new.local_heads}/rank"
    transposed = name in unit.transposed
    if name in unit.replicated_heads:
        n_heads, head_size = unit.replicated_heads[name]
        new = ReplicatedHeadsLinear(child.weight, child.bias, n_heads, head_size, group, transposed=transposed, **extra)
        return new, "replicated", f"{n_heads} head(s) of {head_size} replicated, head {new.head} used"
    if name in unit.qkv_heads:
        heads = unit.qkv_heads[name]
        new = fused_qkv_parallel(child.weight, child.bias, heads, group, transposed=transposed, **extra)
        local = heads.local(group_size(group))
        return new, "column", (f"[q | k | v] heads {heads.n_head}/{heads.n_query_groups} -> {local.n_head}/"
                               f"{local.n_query_groups}"
                               + ("/rank, key/value replicated" if isinstance(new, ReplicatedKVColumnParallel) else "/rank"))
    if name in unit.columns:
        gather = not unit.rows
        new = ColumnParallelLinear.from_weights(child.weight, child.bias, group, chunks=unit.chunks.get(name, 1),
                                                transposed=transposed, gather_output=gather, **extra)
        detail = f"out {new.out_features} -> {new.out_per_rank}/rank" + (", gathered" if gather else "")
        return new, "column", detail + (f", {unit.chunks[name]} blocks split each" if name in unit.chunks else "")
    new = RowParallelLinear.from_weights(child.weight, child.bias, group, transposed=transposed,
                                         input_is_parallel=True, **extra)
    return new, "row", f"in {new.in_features} -> {new.in_per_rank}/rank"


def convert_model(module: nn.Module, group: Any = None, config: Optional[TensorParallelConfig] = None,
                  **layer_kwargs) -> PlanReport:
    """The plan of ``config.plan`` for ``module`` (:func:`~lightning_amp.parallel.plan.build_plan`: read and checked,
    nothing changed), then :func:`convert`; returns the :class:`PlanReport` (what was split, how each unit was found,
    what was left whole and why). ``config``: the options (default ``TensorParallelConfig()``); ``layer_kwargs`` go
    to every parallel layer."""
    config = TensorParallelConfig() if config is None else config
    checked = build_plan(module, config.plan, group_size(group), config.sequence_parallel, config.allow_replicated,
                         config.unsplit_ok, config.sequence_dim)
    return convert(module, checked, group, config, **layer_kwargs)


def convert(module: nn.Module, checked: TensorParallelPlan, group: Any, config: TensorParallelConfig,
            **layer_kwargs) -> PlanReport:
    """The one conversion: replace the layers of ``module`` that ``checked`` splits by this rank's parallel layers of
    ``group``, holding its slices of the existing weights. ``checked`` is a :func:`~lightning_amp.parallel.plan.build_plan`
    of ``module`` (or of a copy: the module paths are what count), automatic or explicit alike; nothing else is read.

    With ``config.sequence_parallel``, ``checked`` must have been checked so (its ``sequence`` placed: ValueError
    otherwise, before anything changes). Order: per unit the attributes its attention reads take their per-rank values,
    its layers are replaced and its per-head inputs cut; last the sequence is split at the boundaries of the runs of
    blocks."""
    tp = group_size(group)
    sequence = checked.sequence if config.sequence_parallel else None
    if config.sequence_parallel and sequence is None:
        raise ValueError("sequence_parallel=True: the plan was checked without sequence parallelism; build it with "
                         "build_plan(..., sequence_parallel=True, sequence_dim=...) or check_plan(...) so")
    sp_kwargs = sequence.layer_kwargs if sequence is not None else {}
    linear_kwargs = dict(layer_kwargs, config=config)  # the layers read their options from it
    report = PlanReport(tp, whole=dict(checked.whole))
    for unit in checked.units:
        split = SplitUnit(unit.family, unit.found_by, _heads_line(unit, tp))
        split.attributes = _set_head_values(module, _head_values(unit, tp))
        _divide_head_counts(module, unit, tp)
        _mark_partial_grads(module, unit)
        split.layers = _convert_unit(module, unit, group, sp_kwargs, linear_kwargs)
        split.heads += install_head_inputs(module, unit, group)
        report.split.append(split)
    if sequence is not None:
        install_boundaries(module, sequence.runs, group)
        report.sequence = [Conversion(run.container, "blocks", "seq-split", line.partition(": ")[2])
                           for run, line in zip(sequence.runs, sequence.describe())]
    return report


def apply_plan(
    module: nn.Module,
    group: Any = None,
    plan: Union[str, Mapping[str, str]] = "auto",
    sequence_parallel: bool = False,
    sequence_dim: Optional[int] = None,
    allow_replicated: bool = False,
    *,
    config: Optional[TensorParallelConfig] = None,
    **linear_kwargs,
) -> list[Conversion]:
    """Validate (see :func:`build_plan`), then replace the planned layers of ``module`` in place;
    returns the conversion table (:func:`convert_model` returns the whole report).

    ``config``: the options (``plan``, ``sequence_parallel``, ``sequence_dim``, ``allow_replicated`` and the
    layers' ``gradient_accumulation_fusion`` / ``async_grad_allreduce``); without it they are built from the
    keywords (``linear_kwargs`` naming those two, the rest going to every parallel layer).
    With a TP group of size 1 the layers are still converted (fused wgrad path).
    ``sequence_parallel``: see :mod:`~lightning_amp.parallel.sequence` (``sequence_dim`` for blocks
    other than ``nn.Transformer*Layer``); a model it cannot handle raises ValueError.
    """
    if config is None:
        layer_options = {k: linear_kwargs.pop(k) for k in _LAYER_OPTIONS if k in linear_kwargs}
        config = TensorParallelConfig(plan=plan, sequence_parallel=sequence_parallel, sequence_dim=sequence_dim,
                                      allow_replicated=allow_replicated, **layer_options)
    return convert_model(module, group, config, **linear_kwargs).conversions


def gathered_state_dict(module: nn.Module) -> dict:
    """``module.state_dict()`` with every parallel layer's entries replaced by the gathered full
    tensors under the original module's keys (collective over each layer's TP group)."""
    state = module.state_dict()
    for name, sub in module.named_modules():
        if isinstance(sub, PARALLEL_LAYERS):
            if any(isinstance(p, PARALLEL_LAYERS) for p in _ancestors(module, name)):
                continue
            prefix = f"{name}." if name else ""
            for key in [k for k in state if k.startswith(prefix)]:
                del state[key]
            for key, value in sub.full_state().items():
                state[prefix + key] = value
    return state


def load_gathered_state_dict(module: nn.Module, state: Mapping[str, Any], strict: bool = True):
    """Load a full (original-layout) state into a converted module, slicing for this rank."""
    state = dict(state)
    for name, sub in module.named_modules():
        if isinstance(sub, PARALLEL_LAYERS):
            if any(isinstance(p, PARALLEL_LAYERS) for p in _ancestors(module, name)):
                continue
            prefix = f"{name}." if name else ""
            mine = {k[len(prefix):]: state.pop(k) for k in [k for k in state if k.startswith(prefix)]}
            sub.load_full_state(mine)
    parallel_keys = {k for k in module.state_dict() if _owned_by_parallel(module, k)}
    missing, unexpected = [], []
    result = module.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if k not in parallel_keys]
    unexpected = list(result.unexpected_keys)
    if strict and (missing or unexpected):
        raise RuntimeError(f"load_gathered_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    return missing, unexpected


def _ancestors(module: nn.Module, name: str):
    parts = name.split(".")
    for i in range(1, len(parts)):
        yield module.get_submodule(".".join(parts[:i]))


def _owned_by_parallel(module: nn.Module, key: str) -> bool:
    parts = key.split(".")
    for i in range(1, len(parts)):
        try:
            sub = module.get_submodule(".".join(parts[:i]))
        except AttributeError:
            return False
        if isinstance(sub, PARALLEL_LAYERS):
            return True
    return False
