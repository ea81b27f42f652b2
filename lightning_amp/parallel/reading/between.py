"""What lies between a column-parallel layer and its row-parallel partner.

A column layer's output is split along its last (feature) dimension; the row layer takes that shard.
Everything the shard passes through on the way must act elementwise on it (activations, dropout, the
product of two column outputs as in a gated MLP): a norm over the features, a BatchNorm with one
running mean per feature, or a view that mixes the split dimension into others would see a shard where
it expects the full tensor (e.g. ``running_mean should contain 16 elements not 32``).

:func:`between_problem` says why a unit cannot be split that way, or None. It traces the unit's parent
module with :mod:`torch.fx` when that works and checks every node on the way from the columns to the
row; a parent fx cannot trace (data-dependent control flow, as in many ``transformers`` layers) is
checked by structure only: no normalisation layer over the split width among the parent's other
children, with a warning that names the parent and fx's reason (the weaker check is never silent).
Nothing is changed or run on real data.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from lightning_amp.parallel.reading.dataflow import _elementwise

_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.RMSNorm)
_NORM_FUNCTIONS = frozenset({F.layer_norm, F.rms_norm, torch.layer_norm, torch.rms_norm})  # (x, normalized_shape, ...)


def between_problem(module: nn.Module, columns: list[str], rows: list[str], width: int,
                    trace: bool = True) -> Optional[str]:
    """Why the split outputs of ``columns`` (paths in ``module``, ``width`` output features each) cannot flow into
    ``rows`` as a shard, or None when everything between acts elementwise (and when they are not all children of one
    parent: then nothing here can be checked).
    ``trace=False`` (explicit plans: the user vouches for the data flow, which may reshape heads as attention
    does) checks only for a norm over the split width: among the parent's children, or, when fx traces the
    parent, on the data flow (a norm module or ``F.layer_norm``/``F.rms_norm`` call)."""
    parent = columns[0].rpartition(".")[0]
    if any(path.rpartition(".")[0] != parent for path in columns + rows):
        return None
    owner = module.get_submodule(parent) if parent else module
    local = {path.rpartition(".")[2] for path in columns}
    rows_local = {path.rpartition(".")[2] for path in rows}
    row = ", ".join(rows)
    if not trace:
        return _norm_sibling(owner, parent, local | rows_local, width) or _norm_on_path(owner, parent, local, rows_local,
                                                                                      columns, row, width)
    try:
        graph = torch.fx.symbolic_trace(owner).graph
    except Exception as error:  # noqa: BLE001 (fx refuses many real forwards: fall back to the structure, loudly)
        reason = (str(error).strip().splitlines() or [""])[0][:200]
        warnings.warn(
            f"tp_fused: torch.fx cannot trace {parent or 'the model'} ({type(owner).__name__}): "
            f"{type(error).__name__}: {reason}. What lies between {', '.join(columns)} and {row} is checked by "
            f"structure only (no normalisation layer over the {width} split features among its children), "
            "not along the data flow.", UserWarning, stacklevel=2)
        return _norm_sibling(owner, parent, local | rows_local, width)
    starts = [n for n in graph.nodes if n.op == "call_module" and n.target in local]
    ends = [n for n in graph.nodes if n.op == "call_module" and n.target in rows_local]
    if not starts or not ends:
        return None  # the layers are not called directly by the parent: nothing to check here
    after_columns = _reach(starts, lambda n: n.users)
    before_row = _reach(ends, lambda n: n.all_input_nodes)
    after_row = _reach(ends, lambda n: n.users)
    for node in graph.nodes:  # in program order: the first offender is named
        if node not in after_columns or node in ends or node in after_row:
            continue
        if node not in before_row:
            return f"the split output reaches {_describe(owner, parent, node)} without passing through {row}"
        if not _elementwise(owner, node):
            return (f"{_describe(owner, parent, node)} acts on the split dimension between "
                    f"{', '.join(columns)} and {row} (only elementwise operations may lie between them)")
        foreign = next((i for i in node.all_input_nodes if i not in after_columns and i not in starts
                        and not _scalar(owner, i)), None)
        if foreign is not None:  # a residual added to the shard: the full tensor meets one rank's features
            return (f"{_describe(owner, parent, node)} combines the split output of {', '.join(columns)} with "
                    f"{_describe(owner, parent, foreign)}, which is not split, on the way to {row} (only elementwise "
                    "functions of the column layers' outputs may reach it)")
    return None


def _scalar(owner: nn.Module, node) -> bool:
    """A one-element tensor attribute (a learned scale), which broadcasts over a shard as over the whole."""
    if node.op != "get_attr":
        return False
    path, _, name = node.target.rpartition(".")
    holder = owner.get_submodule(path) if path else owner
    value = getattr(holder, name, None)
    return isinstance(value, torch.Tensor) and value.numel() == 1


def _norm_on_path(owner: nn.Module, parent: str, local: set, rows_local: set, columns: list[str], row: str,
                  width: int) -> Optional[str]:
    """For explicit pairs, whose data flow may reshape heads on purpose: a norm over the ``width`` split features
    (a module, or ``F.layer_norm``/``F.rms_norm`` called in the forward) on the way from the columns to the row,
    when fx can trace the parent; None when it cannot (the structural check then stands alone)."""
    try:
        graph = torch.fx.symbolic_trace(owner).graph
    except Exception:  # noqa: BLE001 (explicit plans: the structural check, as documented)
        return None
    starts = [n for n in graph.nodes if n.op == "call_module" and n.target in local]
    ends = [n for n in graph.nodes if n.op == "call_module" and n.target in rows_local]
    between = _reach(starts, lambda n: n.users) & _reach(ends, lambda n: n.all_input_nodes)
    for node in graph.nodes:
        if node in between and _normalises(owner, node, width):
            return (f"{_describe(owner, parent, node)} normalises the {width} features {', '.join(columns)} split, "
                    f"on the way to {row}")
    return None


def _normalises(owner: nn.Module, node, width: int) -> bool:
    if node.op == "call_module":
        child = owner.get_submodule(node.target)
        shape = getattr(child, "normalized_shape", None)
        return isinstance(child, _NORMS) and (getattr(child, "num_features", None) == width or bool(shape and shape[-1] == width))
    if node.op == "call_function" and node.target in _NORM_FUNCTIONS:
        shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
        shape = (shape,) if isinstance(shape, int) else shape
        return isinstance(shape, (tuple, list)) and bool(shape) and shape[-1] == width
    return False


def _reach(nodes, step) -> set:
    seen, todo = set(), [m for n in nodes for m in step(n)]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(step(node))
    return seen


def _describe(owner: nn.Module, parent: str, node) -> str:
    if node.op == "call_module":
        path = f"{parent}.{node.target}" if parent else node.target
        return f"{path} ({type(owner.get_submodule(node.target)).__name__})"
    if node.op == "output":
        return "the module's output"
    return f"{getattr(node.target, '__name__', node.target)} ({node.op})"


def _norm_sibling(owner: nn.Module, parent: str, unit_children: set[str], width: int) -> Optional[str]:
    for name, child in owner.named_children():
        if name in unit_children or not isinstance(child, _NORMS):
            continue
        features = getattr(child, "num_features", None) or getattr(child, "num_channels", None)
        shape = getattr(child, "normalized_shape", None)
        if features == width or (shape and shape[-1] == width):
            path = f"{parent}.{name}" if parent else name
            return (f"{path} ({type(child).__name__}) normalises {width} features, the width the column layers "
                    "split; it may lie between them and the row layer")
    return None
