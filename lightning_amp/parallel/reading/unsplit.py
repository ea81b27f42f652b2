"""Attentions ``plan="auto"`` would leave whole: refused at setup unless the user accepts them (``unsplit_ok``).

An attention left whole runs whole on every rank: its weights are not divided and its work is repeated, which is
not what ``tp_fused`` promises. So every *attention module* with a projection (``nn.Linear``, ``Conv1D``) that the
plan leaves whole is refused (:func:`~lightning_amp.parallel.plan.build_plan`, from what :func:`whole_attentions`
reads here): the model, the module path, the reason read from the module itself (its forward cannot be read, it shows no attention product, or its heads cannot be split: not the
reason of an outer module, which misleads), and what to pass instead: the ``plan=`` naming its projections, or, for
a fused projection no plan can split contiguously, ``unsplit_ok=[glob]`` to keep it whole on purpose.

An attention module is one holding an int head-count attribute (``num_heads``, ``n_head``, ``head_dim``, ...) or
whose class name says ``Attention``/``Attn``; a projection belongs to the innermost one above it. A projection
outside every attention module (a vocabulary head) is left whole with its reason, as before.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Collection, Mapping, Optional, Sequence

from torch import nn

from lightning_amp.parallel.reading.dataflow import products, sources
from lightning_amp.parallel.reading.families import HEAD_ATTRS
from lightning_amp.parallel.reading.forward_graph import ForwardUnreadable, read_forward
from lightning_amp.parallel.reading.projections import is_projection, widths_of

_HEAD_COUNTS = HEAD_ATTRS + ("head_dim", "head_size", "num_kv_heads", "n_local_heads", "attention_head_size")
_ATTENTION_CLASS = re.compile(r"attention|attn", re.IGNORECASE)
_OUT_NAMES = ("o_proj", "out_proj", "dense", "c_proj", "proj", "wo", "out")


def is_attention_module(module: nn.Module) -> bool:
    """Whether ``module`` looks like an attention block (see the module docstring)."""
    if _ATTENTION_CLASS.search(type(module).__name__):
        return True
    return any(isinstance(value, int) and not isinstance(value, bool)
               for name, value in vars(module).items() if name in _HEAD_COUNTS)


def _owner(model: nn.Module, path: str) -> Optional[str]:
    """The innermost attention module above the projection ``path``, or None."""
    parts = path.split(".")
    for end in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:end])
        if is_attention_module(model.get_submodule(candidate)):
            return candidate
    return None


def glob_of(path: str) -> str:
    """``path`` with its layer indices as ``*`` (``transformer.h.3.attn`` -> ``transformer.h.*.attn``)."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


@dataclass(frozen=True)
class WholeAttention:
    """An attention module ``plan="auto"`` would leave whole: its class name, why reading it alone does not split it
    (:func:`why_not_split`), and what to pass instead (the ``plan=`` naming its projections, or ``unsplit_ok=``)."""

    type_name: str
    reason: str
    way_out: str


def whole_attentions(model: nn.Module, paths: Sequence[str], problems: Mapping[str, str],
                     planned: Collection[str]) -> tuple[dict[str, str], dict[str, WholeAttention]]:
    """For the projections ``paths`` of ``model``: the attention module each lies in (those in one), and per such
    attention module why it is not split: the ``problems`` of a unit it holds (per projection path: its unit's
    problem), else what reading it alone shows (:func:`why_not_split`; ``planned``: every projection of a unit)."""
    attention_of = {path: owner for path in paths if (owner := _owner(model, path)) is not None}
    known = {owner: problems[path] for path, owner in attention_of.items() if path in problems}
    return attention_of, {owner: WholeAttention(type(model.get_submodule(owner)).__name__,
                                                known.get(owner) or why_not_split(model, owner, planned),
                                                _way_out(model, owner))
                          for owner in dict.fromkeys(attention_of.values())}


def why_not_split(model: nn.Module, path: str, planned: Collection[str] = ()) -> str:
    """What reading the attention module ``path`` alone shows: why its projections are not a unit of the plan
    (``planned``: the projections of the plan's units)."""
    module = model.get_submodule(path)
    projections = [name for name, m in module.named_modules() if is_projection(m)]
    if not projections:
        return "it holds no projection"
    try:
        graph = read_forward(module, widths_of(module.get_submodule(projections[0]))[0])
    except ForwardUnreadable as error:
        return f"torch.fx cannot read its forward ({str(error)[:200]})"
    found = products(graph)
    if not found:
        return ("its forward, read alone, shows no attention product (F.scaled_dot_product_attention, or "
                "softmax(q @ k^T) @ v) between its projections")
    q, k, v, result = found[0]
    streams = [sources(graph, a) for a in (q, k, v)]
    if any(len(s) != 1 for s in streams):
        named = [sorted(str(n.target) for n in s) for s in streams]
        return f"its query, key and value do not each come from one projection (from {named})"
    members = list(dict.fromkeys(f"{path}.{next(iter(s)).target}" for s in streams))
    outs = [f"{path}.{name}" for name in projections if f"{path}.{name}" not in members]
    if len(outs) != 1:
        return f"its query, key and value come from {members}, but no single out-projection takes their product"
    if len(members) == 2:
        return (f"its query, key and value come from two projections ({', '.join(members)}; one fused for two of "
                "them): not a layout tp_fused splits")
    elsewhere = [p for p in members + outs if p in planned]
    if elsewhere:
        return (f"reading it alone shows an attention from {', '.join(members)} to {outs[0]}, but "
                f"{', '.join(elsewhere)} belong(s) to another unit of the plan")
    return "reading it alone shows an attention, but the reading of the whole model did not find it"


def _way_out(model: nn.Module, path: str) -> str:
    module = model.get_submodule(path)
    layers = {name: m for name, m in module.named_children() if is_projection(m)}
    glob = glob_of(path)
    keep = f"To train it whole on every rank on purpose, pass unsplit_ok=[{glob!r}]."
    if len(layers) < 2:
        return keep
    row = next((n for n in _OUT_NAMES if n in layers), list(layers)[-1])
    columns = [n for n in layers if n != row]
    width = widths_of(layers[row])[0]
    fused = [n for n in columns if widths_of(layers[n])[1] > width]
    if fused:
        return (f"Its {', '.join(fused)} is a fused projection: an explicit plan= splits a Linear contiguously and "
                "refuses a fused one whose layout it cannot read, so no plan= splits this attention until it is one "
                f"Linear per query, key and value. {keep}")
    plan = {f"{glob}.{n}": "column" for n in columns}
    plan[f"{glob}.{row}"] = "row"
    return f"To split it by its names, pass plan={plan} (with the model's other layers); or: {keep}"
