"""Which layers become tensor-parallel (the plan), its validation, and the in-place conversion.

``plan="auto"`` takes the units of :mod:`~lightning_amp.parallel.auto_units`: the known layouts of
:mod:`~lightning_amp.parallel.families` (``nn.MultiheadAttention``/``nn.Transformer``, ``transformers`` BERT/RoBERTa,
GPT-2, litgpt's fused ``[q | k | v]`` attention, named MLPs, MLPs in ``nn.Sequential``), then the attention blocks and
MLPs :mod:`~lightning_amp.parallel.structure` finds by reading the forward of the rest (their heads and the attribute
values one rank needs: :mod:`~lightning_amp.parallel.heads`), then q/k/v/o names where no forward can be read. An
explicit plan ``{"glob.of.module.names": "column" | "row" | "replicate"}`` is used *instead* (fnmatch globs on names
from ``named_modules()``); a set of explicit layers that forms one of those units gets that unit's layout (fused QKV,
``Conv1D``, heads and head attributes), other layers pair by parent: a column layer's output stays split when its
parent also holds a row layer of the plan, else it is gathered.

:func:`build_plan` validates the whole plan *before anything changes*, raising ValueError naming
the module paths when a column layer would feed anything but its row partner (a unit only partly in
an explicit plan, a row layer without a column partner, a norm or reshape between a named MLP's layers:
:mod:`~lightning_amp.parallel.between`, an explicit column wider than its row partner outside any unit:
a fused projection a contiguous split would cut), when a glob of an explicit plan matches no module,
when heads or features do not divide by the TP size (key/value heads: nor divide it), when an attention found by
structure cannot be read, or when nothing would be split (unless ``allow_replicated``). So a model is either
converted as planned or left untouched: never half-converted. Conversion copies this rank's slice of
the module's *current* weights; :func:`convert_model` returns the :class:`~lightning_amp.parallel.report.PlanReport`.
"""
from __future__ import annotations

import copy
import difflib
import fnmatch
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from torch import nn

from lightning_amp.parallel.attention import ParallelMultiheadAttention
from lightning_amp.parallel.auto_units import auto_units
from lightning_amp.parallel.between import between_problem
from lightning_amp.parallel.config import KINDS, TensorParallelConfig, validate_plan, validate_unsplit_ok  # noqa: F401
from lightning_amp.parallel.families import HEAD_ATTRS, Unit, is_conv1d, multihead_attention_unit
from lightning_amp.parallel.fused_qkv import ReplicatedKVColumnParallel, fused_qkv_parallel
from lightning_amp.parallel.groups import group_size
from lightning_amp.parallel.head_inputs import install_head_inputs
from lightning_amp.parallel.heads import AttentionShape
from lightning_amp.parallel.layers import ColumnParallelLinear, RowParallelLinear
from lightning_amp.parallel.main_grad import mark_sequence_parallel
from lightning_amp.parallel.projections import is_projection
from lightning_amp.parallel.replicated_heads import ReplicatedHeadsLinear
from lightning_amp.parallel.report import Conversion, PlanReport, SplitUnit
from lightning_amp.parallel.sequence import install_boundaries, plan_runs
from lightning_amp.parallel.shared_input import SharedInput
from lightning_amp.parallel.unsplit import accepted, unmatched_globs, unsplit_problems

_LAYER_OPTIONS = ("gradient_accumulation_fusion", "async_grad_allreduce")  # config fields the layers read
#: the layers a conversion makes (a model holding one is converted already)
PARALLEL_LAYERS = (ParallelMultiheadAttention, ReplicatedKVColumnParallel, ReplicatedHeadsLinear, ColumnParallelLinear,
                   RowParallelLinear)


@dataclass
class Plan:
    """A validated plan: the units to convert, per layer path its kind, and per Linear left whole, why."""

    units: list[Unit]
    decisions: dict[str, str] = field(default_factory=dict)
    whole: dict[str, str] = field(default_factory=dict)


def _explicit_decisions(module: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    decisions: dict[str, str] = {}
    names = [name for name, _ in module.named_modules() if name]
    for pattern in plan:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            close = difflib.get_close_matches(pattern, names, n=3)
            raise ValueError(f"tp_fused plan: {pattern!r} matches no module of {type(module).__name__}"
                             + (f" (close: {close})" if close else f" (its modules are named like {names[:3]})"))
    for name, child in module.named_modules():
        for pattern, kind in plan.items():
            if name and fnmatch.fnmatchcase(name, pattern):
                if kind != "replicate" and not (isinstance(child, (nn.Linear, nn.MultiheadAttention)) or is_conv1d(child)):
                    raise ValueError(f"plan: {name!r} matched {pattern!r} but is a {type(child).__name__}, not nn.Linear")
                if kind != "replicate" and isinstance(child, nn.MultiheadAttention):
                    kind = "attention"
                decisions[name] = kind
    return {n: k for n, k in decisions.items() if k != "replicate"}


def _unit_kinds(unit: Unit) -> dict[str, str]:
    kinds = {unit.attention: "attention"} if unit.attention else {}
    kinds.update({c: "column" for c in unit.columns})
    kinds.update({r: "row" for r in unit.rows})
    return kinds


def _explicit_units(module: nn.Module, decisions: dict[str, str], tp: int) -> list[Unit]:
    """Explicit layers grouped into units: the units ``plan="auto"`` finds when complete (their heads and layout),
    else column/row by parent."""
    units, left = [], dict(decisions)
    for unit in auto_units(module, tp).units:
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
        if kind == "attention":
            units += multihead_attention_unit(name, module.get_submodule(name))
            continue
        unit = by_parent.setdefault(parent, Unit("explicit", heads=parent))
        (unit.columns if kind == "column" else unit.rows).append(name)
        if is_conv1d(module.get_submodule(name)):
            unit.transposed.add(name)
    for parent, unit in by_parent.items():
        if unit.rows and not unit.columns:
            raise ValueError(f"tp_fused plan: row-parallel {unit.rows} in {parent or 'the model'!r} have no "
                             "column-parallel partner in the same parent, so their input would not be split")
        if not unit.rows:  # lone column layers gather their outputs: nothing downstream sees a shard
            unit.heads = None
        unit.problem = _fused_column(module, unit)
        units.append(unit)
    return units


def _fused_column(module: nn.Module, unit: Unit) -> Optional[str]:
    """Why an explicit column/row pair outside any known family would be cut wrongly, or None: a column
    layer with more outputs than its row partner takes is a fused projection (``[q | k | v]``,
    ``[gate | up]``) whose output is split into blocks before the row layer, and a contiguous split of
    its rows would give each rank whole blocks of one kind and none of another."""
    if not unit.rows:
        return None  # gathered outputs: the whole fused tensor is put back together
    widest = max(_dims(module, r)[0] for r in unit.rows)
    for column in unit.columns:
        width = _dims(module, column)[1]
        if width > widest:
            return (f"{column} has {width} outputs but {', '.join(unit.rows)} take(s) {widest} inputs: a fused "
                    "projection (e.g. [q | k | v] or [gate | up]) that a contiguous split would cut across its blocks, "
                    "no family this plan knows says how to split it by heads. Split it into one Linear per block, or "
                    "leave it out of the plan")
    return None


def _dims(module: nn.Module, name: str) -> tuple[int, int]:
    child = module.get_submodule(name)
    return (child.nx, child.nf) if is_conv1d(child) else (child.in_features, child.out_features)


def build_plan(module: nn.Module, plan: Union[str, Mapping[str, str]], tp: int,
               sequence_parallel: bool = False, allow_replicated: bool = False, unsplit_ok: Sequence[str] = ()) -> Plan:
    """The validated plan for ``module`` at TP size ``tp``; changes nothing. Raises ValueError naming the
    module paths of every unit that cannot be split, of every attention ``plan="auto"`` would leave whole that
    no glob of ``unsplit_ok`` accepts (:mod:`~lightning_amp.parallel.unsplit`), and when nothing would be split
    at ``tp > 1`` unless ``allow_replicated``."""
    validate_plan(plan)
    unsplit_ok = validate_unsplit_ok(unsplit_ok)
    problems = [f"unsplit_ok: {glob!r} matches no module of {type(module).__name__}"
                for glob in unmatched_globs(module, unsplit_ok)]
    if plan == "auto":
        found = auto_units(module, tp)
        units, whole = found.units, found.whole
        if tp > 1:
            units = _accept_unsplit(units, whole, unsplit_ok)
            if units or not allow_replicated:  # allow_replicated with nothing split: every layer whole on purpose
                problems += unsplit_problems(module, whole, tp, unsplit_ok)
    else:
        units = _explicit_units(module, _explicit_decisions(module, plan), tp)
        planned = {m for u in units for m in u.members}
        whole = {name: "not named by the plan" for name, m in module.named_modules()
                 if is_projection(m) and name not in planned}
    for unit in units:
        if unit.problem:
            problems.append(f"{', '.join(unit.members)} ({unit.family}): {unit.problem}")
            continue
        sizes = list(unit.divisible)
        sizes += [(f"{c}.out_features", _dims(module, c)[1] // unit.chunks.get(c, 1)) for c in unit.columns
                  if c not in unit.qkv_heads and c not in unit.replicated_heads]
        sizes += [(f"{r}.in_features", _dims(module, r)[0]) for r in unit.rows]
        bad = [f"{what}={value}" for what, value in sizes if value < tp or value % tp]
        if bad:
            problems.append(f"{', '.join(unit.members)} ({unit.family}): {'; '.join(bad)} not divisible by "
                            f"tensor_parallel_size={tp}")
        problems += [f"{c} ({unit.family}): {heads.problem(tp)}" for c, heads in unit.qkv_heads.items() if heads.problem(tp)]
        problem = _between(module, unit)
        if problem:
            problems.append(f"{', '.join(unit.members)} ({unit.family}): {problem}")
        if sequence_parallel and (unit.chunks or unit.transposed or len({n.rpartition('.')[0] for n in unit.columns + unit.rows}) > 1):
            problems.append(f"{', '.join(unit.members)} ({unit.family}): sequence_parallel=True is supported for "
                            "nn.MultiheadAttention and for column/row layers in one parent module only")
    if problems:
        raise ValueError("tp_fused: the plan cannot be applied (nothing was changed):\n  " + "\n  ".join(problems)
                         + "\nChoose a tensor_parallel_size that divides them, pass plan={'glob': 'column'|'row'|"
                         "'replicate'} to pick the layers to split, or unsplit_ok=['glob.of.attention'] to keep an "
                         "attention whole on every rank on purpose.")
    if not units and tp > 1 and not allow_replicated:
        raise ValueError(
            f"tp_fused: no layer of {type(module).__name__} can be split across {tp} ranks (no nn.MultiheadAttention, "
            "attention product between its projections or column -> elementwise -> row MLP found); every rank would train "
            "the whole model. Pass plan={'glob.of.names': 'column'|'row'} to choose layers, or "
            "TensorParallelStrategy(allow_replicated=True) to train replicated on purpose."
            + "".join(f"\n  {name}: {why}" for name, why in list(whole.items())[:8]))
    result = Plan(units, whole=whole)
    for unit in units:
        result.decisions.update(_unit_kinds(unit))
    return result


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


#: families whose column -> row data flow is not fixed by the family's own code and must be checked
_FREE_FLOW = {"named MLP": True, "explicit": False}  # family -> trace the parent's forward with torch.fx


def _between(module: nn.Module, unit: Unit) -> Optional[str]:
    if unit.family not in _FREE_FLOW or not unit.columns or not unit.rows:
        return None
    parent = unit.columns[0].rpartition(".")[0]
    if any(name.rpartition(".")[0] != parent for name in unit.columns + unit.rows):
        return None
    width = _dims(module, unit.columns[0])[1]
    return between_problem(module, parent, unit.columns, unit.rows, width, trace=_FREE_FLOW[unit.family])


def _parent(module: nn.Module, name: str):
    parent_name, _, attr = name.rpartition(".")
    return (module.get_submodule(parent_name) if parent_name else module), parent_name, attr


def _convert_unit(module: nn.Module, unit: Unit, group: Any, sp_kwargs: dict, linear_kwargs: dict) -> list[Conversion]:
    rows = []
    if unit.attention:
        parent, _, attr = _parent(module, unit.attention)
        child = getattr(parent, attr)
        new = ParallelMultiheadAttention(child, group, **sp_kwargs.get(unit.attention, {}), **linear_kwargs)
        setattr(parent, attr, new)
        rows.append(Conversion(unit.attention, type(child).__name__, "attention",
                               f"{child.num_heads} heads -> {new.local_heads}/rank"))
    for name in unit.columns + unit.rows:
        parent, _, attr = _parent(module, name)
        child = getattr(parent, attr)
        extra = dict(sp_kwargs.get(name, {}), **linear_kwargs)
        transposed = name in unit.transposed
        if name in unit.qkv_heads:
            heads = unit.qkv_heads[name]
            new = fused_qkv_parallel(child.weight, child.bias, heads, group, transposed=transposed, **extra)
            local = heads.local(group_size(group))
            detail = (f"[q | k | v] heads {heads.n_head}/{heads.n_query_groups} -> {local.n_head}/{local.n_query_groups}"
                      + ("/rank, key/value replicated" if isinstance(new, ReplicatedKVColumnParallel) else "/rank"))
        elif name in unit.replicated_heads:
            n_heads, head_size = unit.replicated_heads[name]
            new = ReplicatedHeadsLinear(child.weight, child.bias, n_heads, head_size, group, transposed=transposed, **extra)
            detail = f"{n_heads} head(s) of {head_size} replicated, head {new.head} used"
        elif name in unit.columns:
            gather = not unit.rows
            new = ColumnParallelLinear.from_weights(child.weight, child.bias, group, chunks=unit.chunks.get(name, 1),
                                                    transposed=transposed, gather_output=gather, **extra)
            detail = f"out {new.out_features} -> {new.out_per_rank}/rank" + (", gathered" if gather else "")
            if name in unit.chunks:
                detail += f", {unit.chunks[name]} blocks split each"
        else:
            new = RowParallelLinear.from_weights(child.weight, child.bias, group, transposed=transposed,
                                                 input_is_parallel=True, **extra)
            detail = f"in {new.in_features} -> {new.in_per_rank}/rank"
        setattr(parent, attr, new)
        kind = "replicated" if name in unit.replicated_heads else "column" if name in unit.columns else "row"
        rows.append(Conversion(name, type(child).__name__, kind, detail))
    _share_input(module, unit, group)
    return rows


def _share_input(module: nn.Module, unit: Unit, group: Any) -> None:
    """Give the unit's column layers one input collective (:mod:`~lightning_amp.parallel.shared_input`) when two or
    more of them take their input alike (the same sequence-parallel mode, outputs not gathered)."""
    columns = [module.get_submodule(name) for name in unit.columns]
    columns = [c for c in columns if hasattr(c, "shared_input") and not getattr(c, "gather_output", False)]
    modes = {(c.sequence_parallel, c.sequence_dim) for c in columns}
    if len(columns) > 1 and len(modes) == 1 and group_size(group) > 1:
        ((sequence_parallel, sequence_dim),) = modes
        shared = SharedInput(group, sequence_parallel, sequence_dim)
        for column in columns:
            column.shared_input = shared


def _set_head_values(module: nn.Module, unit: Unit) -> dict[str, tuple[int, int]]:
    """Give the attributes a structure-found attention's forward reads the values one rank needs (see
    :mod:`~lightning_amp.parallel.heads`): a module's own attribute is set on it; a field of a plain object (a
    ``config``, maybe shared with the whole model) is set on a per-rank copy that every module of the attention
    holding that object gets. Returns {attribute path: (before, after)}."""
    changed, copies = {}, {}
    owner_paths = {path for path, _ in unit.head_values}
    for (path, names), value in sorted(unit.head_values.items()):
        owner = module.get_submodule(path) if path else module
        label = ".".join([path, *names]) if path else ".".join(names)
        if len(names) == 1:
            changed[label] = (getattr(owner, names[0]), value)
            setattr(owner, names[0], value)
            continue
        shared = getattr(owner, names[0])
        if id(shared) not in copies:
            copies[id(shared)] = (shared, copy.copy(shared))  # a shallow copy keeps what __post_init__ derived
        original, private = copies[id(shared)]
        changed[label] = (getattr(original, names[1]), value)
        vars(private)[names[1]] = value
    for original, private in copies.values():
        for path in owner_paths:
            for sub in (module.get_submodule(path) if path else module).modules():
                for attr, held in list(vars(sub).items()):
                    if held is original:
                        setattr(sub, attr, private)
    return changed


def _mark_partial_grads(module: nn.Module, unit: Unit) -> None:
    """Params used between the unit's columns and rows see this rank's heads only: their gradients are summed over
    the TP group (the ``sequence_parallel`` mark :class:`~lightning_amp.parallel.main_grad.MainGradBuffer` reads)."""
    for path in unit.partial_grads:
        try:
            mark_sequence_parallel(module.get_submodule(path))
        except AttributeError:
            module.get_parameter(path).sequence_parallel = True


def _divide_head_attrs(module: nn.Module, unit: Unit, tp: int) -> None:
    if unit.head_config is not None:  # litgpt: a per-rank copy of the Config the whole model shares
        owner = module.get_submodule(unit.head_config)
        (heads,) = (h.local(tp) for h in unit.qkv_heads.values())
        owner.config = copy.copy(owner.config)  # a shallow copy keeps the fields __post_init__ derived (rope_n_elem)
        owner.config.n_head, owner.config.n_query_groups = heads.n_head, heads.n_query_groups
    if unit.heads is None or not unit.rows:
        return
    owner = module.get_submodule(unit.heads) if unit.heads else module
    for attr in HEAD_ATTRS:
        value = getattr(owner, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(owner, attr, value // tp)


def convert_model(module: nn.Module, group: Any = None, config: Optional[TensorParallelConfig] = None,
                  **layer_kwargs) -> PlanReport:
    """Validate (see :func:`build_plan`), then replace the planned layers of ``module`` in place with this rank's
    parallel layers; returns the :class:`~lightning_amp.parallel.report.PlanReport` (what was split, how each unit
    was found, what was left whole and why). ``config``: the options (default ``TensorParallelConfig()``);
    ``layer_kwargs`` go to every parallel layer."""
    config = TensorParallelConfig() if config is None else config
    checked = build_plan(module, config.plan, group_size(group), config.sequence_parallel, config.allow_replicated,
                         config.unsplit_ok)
    return apply_checked_plan(module, checked, group, config, **layer_kwargs)


def apply_checked_plan(module: nn.Module, checked: Plan, group: Any, config: TensorParallelConfig,
                       **layer_kwargs) -> PlanReport:
    """Convert ``module`` as ``checked`` (a :func:`build_plan` of it, or of a copy: the module paths are what count)
    says, for this rank of ``group``; see :func:`convert_model`."""
    linear_kwargs = dict(layer_kwargs, config=config)  # the layers read their options from it
    tp = group_size(group)
    runs, sp_kwargs = [], {}
    if config.sequence_parallel:
        if not checked.units:
            raise ValueError(f"sequence_parallel=True: the plan found no layer of {type(module).__name__} to split")
        if any(u.columns and not u.rows for u in checked.units):
            raise ValueError("sequence_parallel=True: column layers "
                             f"{[c for u in checked.units if not u.rows for c in u.columns]} have no row-parallel partner")
        runs, sp_kwargs = plan_runs(module, checked.decisions, config.sequence_dim)
    report = PlanReport(tp, whole=dict(checked.whole))
    for unit in checked.units:
        split = SplitUnit(unit.family, unit.found_by, _heads_line(unit, tp))
        split.layers = _convert_unit(module, unit, group, sp_kwargs, linear_kwargs)
        split.attributes = _set_head_values(module, unit)
        split.heads += install_head_inputs(module, unit, group)
        _mark_partial_grads(module, unit)
        _divide_head_attrs(module, unit, tp)
        report.split.append(split)
    if config.sequence_parallel:
        install_boundaries(module, runs, group)
        report.sequence = [Conversion(run.container, "blocks", "seq-split",
                                      f"{len(run.names)} block(s), sequence dim {run.seq_dim} split between them")
                           for run in runs]
    return report


def _heads_line(unit: Unit, tp: int) -> str:
    shape = unit.attention_shape
    if shape is None and len(unit.qkv_heads) == 1:  # litgpt's, found by names
        (heads,) = unit.qkv_heads.values()
        shape = AttentionShape(heads.n_head, heads.n_query_groups, heads.head_size, heads.head_size, "blocks")
    return shape.describe(tp) if shape is not None else ""


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
