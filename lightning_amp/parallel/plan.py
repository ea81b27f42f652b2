"""Which layers become tensor-parallel, and the in-place conversion of a user's module.

``plan="auto"`` finds, in every module:

* ``nn.MultiheadAttention`` (also inside ``nn.Transformer*`` and Lightning's demo Transformer)
  -> :class:`ParallelMultiheadAttention` (heads split);
* projections named like BERT/GPT/Llama code: ``q_proj,k_proj,v_proj,query,key,value,up_proj,
  gate_proj,fc1,dense_h_to_4h,c_fc`` -> column (output stays split), ``o_proj,out_proj,down_proj,
  fc2,dense_4h_to_h,c_proj`` -> row (input is split), when the parent holds both kinds; the
  parent's head-count attributes (``num_heads, n_heads, num_attention_heads, n_head,
  num_key_value_heads, all_head_size``) are divided by the TP size;
* MLP pairs: two ``nn.Linear`` children separated only by elementwise modules (activations,
  dropout), the first's ``out_features`` equal to the second's ``in_features`` -> column, row.

An explicit plan ``{"glob.of.module.names": "column" | "row" | "replicate"}`` is used *instead*
of the automatic one (fnmatch globs on names from ``named_modules()``). A column layer's output
stays split when its parent also holds a row layer of the plan, else it is gathered.

Layers that cannot be split evenly stay replicated with a warning (auto) or raise ValueError
(explicit plan). Conversion copies this rank's slice of the module's *current* weights.
"""
from __future__ import annotations

import fnmatch
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from torch import nn

from lightning_amp.parallel.attention import ParallelMultiheadAttention
from lightning_amp.parallel.groups import group_size
from lightning_amp.parallel.layers import ColumnParallelLinear, RowParallelLinear
from lightning_amp.parallel.sequence import install_boundaries, plan_runs, validate_sequence_dim

COLUMN_NAMES = {"q_proj", "k_proj", "v_proj", "query", "key", "value", "up_proj", "gate_proj", "fc1", "dense_h_to_4h", "c_fc", "w1", "w3"}
ROW_NAMES = {"o_proj", "out_proj", "down_proj", "fc2", "dense_4h_to_h", "c_proj", "w2"}
HEAD_ATTRS = ("num_heads", "n_heads", "num_attention_heads", "n_head", "num_key_value_heads", "all_head_size")
ELEMENTWISE = (
    nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.LeakyReLU, nn.Mish, nn.ELU, nn.Softplus,
    nn.Hardswish, nn.Identity, nn.ReLU6, nn.SELU, nn.CELU, nn.Hardtanh,
)
KINDS = ("column", "row", "replicate")


@dataclass
class Conversion:
    """One row of the conversion table."""

    name: str
    original: str
    kind: str  # "column" | "row" | "attention" | "replicated"
    detail: str


def validate_plan(plan: Union[str, Mapping[str, str]]) -> None:
    if plan == "auto":
        return
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan must be 'auto' or a dict {{glob: 'column'|'row'|'replicate'}}, got {plan!r}")
    for pattern, kind in plan.items():
        if not isinstance(pattern, str) or kind not in KINDS:
            raise ValueError(f"plan entry {pattern!r}: {kind!r} must be one of {KINDS}")


def _auto_decisions(module: nn.Module) -> dict[str, str]:
    """name -> "column" | "row" | "attention" for the automatic plan."""
    decisions: dict[str, str] = {}
    for parent_name, parent in module.named_modules():
        prefix = f"{parent_name}." if parent_name else ""
        children = list(parent.named_children())
        if isinstance(parent, ParallelMultiheadAttention):
            continue
        named_col = [n for n, c in children if isinstance(c, nn.Linear) and n in COLUMN_NAMES]
        named_row = [n for n, c in children if isinstance(c, nn.Linear) and n in ROW_NAMES]
        if named_col and named_row and not isinstance(parent, nn.MultiheadAttention):
            for n in named_col:
                decisions[prefix + n] = "column"
            for n in named_row:
                decisions[prefix + n] = "row"
            continue
        pending: Optional[tuple[str, nn.Linear]] = None
        for n, child in children:
            full = prefix + n
            if isinstance(child, nn.MultiheadAttention):
                decisions[full] = "attention"
                pending = None
            elif isinstance(child, nn.Linear):
                if pending is not None and pending[1].out_features == child.in_features and pending[0] not in decisions:
                    decisions[pending[0]] = "column"
                    decisions[full] = "row"
                    pending = None
                else:
                    pending = (full, child)
            elif not isinstance(child, ELEMENTWISE):
                pending = None
    return decisions


def _explicit_decisions(module: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    decisions: dict[str, str] = {}
    for name, child in module.named_modules():
        for pattern, kind in plan.items():
            if name and fnmatch.fnmatchcase(name, pattern):
                if kind != "replicate" and not isinstance(child, (nn.Linear, nn.MultiheadAttention)):
                    raise ValueError(f"plan: {name!r} matched {pattern!r} but is a {type(child).__name__}, not nn.Linear")
                if kind != "replicate" and isinstance(child, nn.MultiheadAttention):
                    kind = "attention"
                decisions[name] = kind
    return {n: k for n, k in decisions.items() if k != "replicate"}


def _parent(module: nn.Module, name: str):
    parent_name, _, attr = name.rpartition(".")
    return (module.get_submodule(parent_name) if parent_name else module), parent_name, attr


def apply_plan(
    module: nn.Module,
    group: Any = None,
    plan: Union[str, Mapping[str, str]] = "auto",
    sequence_parallel: bool = False,
    sequence_dim: Optional[int] = None,
    **linear_kwargs,
) -> list[Conversion]:
    """Replace the planned layers of ``module`` in place; returns the conversion table.

    ``linear_kwargs`` (``gradient_accumulation_fusion``, ``async_grad_allreduce``, ...) go to every
    parallel layer. With a TP group of size 1 the layers are still converted (fused wgrad path).
    ``sequence_parallel``: see :mod:`~lightning_amp.parallel.sequence` (``sequence_dim`` for blocks
    other than ``nn.Transformer*Layer``); a model it cannot handle raises ValueError, and no layer
    may stay replicated.
    """
    validate_plan(plan)
    validate_sequence_dim(sequence_dim)
    explicit = plan != "auto"
    decisions = _explicit_decisions(module, plan) if explicit else _auto_decisions(module)
    tp = group_size(group)
    runs, sp_kwargs = [], {}
    if sequence_parallel:
        if not decisions:
            raise ValueError(f"sequence_parallel=True: the plan found no layer of {type(module).__name__} to split")
        runs, sp_kwargs = plan_runs(module, decisions, sequence_dim)
    rows: list[Conversion] = []
    parents_with_row = {name.rpartition(".")[0] for name, kind in decisions.items() if kind == "row"}
    converted_parents: dict[str, nn.Module] = {}
    # a column/row pair must be converted both or neither: check divisibility first
    failed: set[str] = set()  # parents whose column/row group cannot be split
    failed_attention: set[str] = set()
    for name, kind in decisions.items():
        child = module.get_submodule(name)
        problem = None
        if kind == "column" and child.out_features % tp:
            problem = f"out_features={child.out_features} is not divisible by tensor_parallel_size={tp}"
        elif kind == "row" and child.in_features % tp:
            problem = f"in_features={child.in_features} is not divisible by tensor_parallel_size={tp}"
        elif kind == "attention" and (child.num_heads % tp or child.bias_k is not None or child.add_zero_attn):
            problem = (f"num_heads={child.num_heads} is not divisible by tensor_parallel_size={tp}"
                       if child.num_heads % tp else "add_bias_kv/add_zero_attn are not supported")
        if problem is not None:
            if explicit or sequence_parallel:
                raise ValueError(f"tp_fused plan: cannot split {name!r} ({type(child).__name__}): {problem}")
            if kind in ("column", "row"):
                failed.add(name.rpartition(".")[0])
            else:
                failed_attention.add(name)
            rows.append(Conversion(name, type(child).__name__, "replicated", problem))
    for name, kind in decisions.items():
        parent, parent_name, attr = _parent(module, name)
        if name in failed_attention:
            continue
        if parent_name in failed and kind in ("column", "row"):
            if not any(r.name == name for r in rows):
                rows.append(Conversion(name, type(getattr(parent, attr)).__name__, "replicated", "partner layer not split"))
            continue
        child = getattr(parent, attr)
        extra = sp_kwargs.get(name, {})
        if kind == "attention":
            new = ParallelMultiheadAttention(child, group, **extra, **linear_kwargs)
            detail = f"{child.num_heads} heads -> {new.local_heads}/rank"
        elif kind == "column":
            gather = parent_name not in parents_with_row
            if gather and sequence_parallel:
                raise ValueError(f"sequence_parallel=True: column layer {name!r} has no row-parallel partner in its parent")
            new = ColumnParallelLinear.from_linear(child, group, gather_output=gather, **extra, **linear_kwargs)
            detail = f"out {child.out_features} -> {new.out_per_rank}/rank" + (", gathered" if gather else "")
        else:
            new = RowParallelLinear.from_linear(child, group, input_is_parallel=True, **extra, **linear_kwargs)
            detail = f"in {child.in_features} -> {new.in_per_rank}/rank"
        setattr(parent, attr, new)
        converted_parents[parent_name] = parent
        rows.append(Conversion(name, type(child).__name__, kind, detail))
    for parent_name, parent in converted_parents.items():
        if isinstance(parent, nn.MultiheadAttention):
            continue
        names = [n for n, k in decisions.items() if n.rpartition(".")[0] == parent_name and k in ("column", "row")]
        if not (set(n.rpartition(".")[2] for n in names) & (COLUMN_NAMES | ROW_NAMES)):
            continue
        for attr in HEAD_ATTRS:
            value = getattr(parent, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                if value % tp:
                    raise ValueError(f"{parent_name or 'model'}.{attr}={value} is not divisible by tensor_parallel_size={tp}")
                setattr(parent, attr, value // tp)
    if sequence_parallel:
        install_boundaries(module, runs, group)
        for run in runs:
            rows.append(Conversion(run.container, "blocks", "seq-split",
                                   f"{len(run.names)} block(s), sequence dim {run.seq_dim} split between them"))
    failed_rows = [r for r in rows if r.kind == "replicated"]
    for r in failed_rows:
        warnings.warn(f"tp_fused: {r.name} ({r.original}) stays replicated: {r.detail}", UserWarning, stacklevel=2)
    if not any(r.kind != "replicated" for r in rows) and tp > 1:
        warnings.warn(
            f"tp_fused: no layer of {type(module).__name__} could be split across {tp} ranks (no nn.Linear pairs, "
            "nn.MultiheadAttention or q/k/v/o, up/down projections found); the model stays fully replicated. "
            "Pass plan={'glob.of.names': 'column'|'row'} to choose layers.",
            UserWarning,
            stacklevel=2,
        )
    return rows


def format_table(rows: list[Conversion]) -> str:
    """A short text table of the conversions."""
    if not rows:
        return "tp_fused: no layers converted"
    w = max(len(r.name) for r in rows)
    lines = [f"{'module':<{w}}  {'was':<18} {'now':<10} detail"]
    lines += [f"{r.name:<{w}}  {r.original:<18} {r.kind:<10} {r.detail}" for r in rows]
    return "\n".join(lines)


def gathered_state_dict(module: nn.Module) -> dict:
    """``module.state_dict()`` with every parallel layer's entries replaced by the gathered full
    tensors under the original module's keys (collective over each layer's TP group)."""
    state = module.state_dict()
    for name, sub in module.named_modules():
        if isinstance(sub, (ParallelMultiheadAttention, ColumnParallelLinear, RowParallelLinear)):
            if any(isinstance(p, ParallelMultiheadAttention) for p in _ancestors(module, name)):
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
        if isinstance(sub, (ParallelMultiheadAttention, ColumnParallelLinear, RowParallelLinear)):
            if any(isinstance(p, ParallelMultiheadAttention) for p in _ancestors(module, name)):
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
        if isinstance(sub, (ParallelMultiheadAttention, ColumnParallelLinear, RowParallelLinear)):
            return True
    return False
