"""Attentions ``plan="auto"`` would leave whole: refused at setup unless the user accepts them (``unsplit_ok``).

An attention left whole runs whole on every rank: its weights are not divided and its work is repeated, which is
not what ``tp_fused`` promises. So every *attention module* with a projection (``nn.Linear``, ``Conv1D``) that the
plan leaves whole is refused by :func:`unsplit_problems`: the model, the module path, the reason read from the
module itself (its forward cannot be read, it shows no attention product, or its heads cannot be split: not the
reason of an outer module, which misleads), and what to pass instead: the ``plan=`` naming its projections, or, for
a fused projection no plan can split contiguously, ``unsplit_ok=[glob]`` to keep it whole on purpose.

An attention module is one holding an int head-count attribute (``num_heads``, ``n_head``, ``head_dim``, ...) or
whose class name says ``Attention``/``Attn``; a projection belongs to the innermost one above it. A projection
outside every attention module (a vocabulary head) is left whole with its reason, as before.
"""
from __future__ import annotations

import fnmatch
import re
from typing import Optional, Sequence

from torch import nn

from lightning_amp.parallel.reading.families import HEAD_ATTRS
from lightning_amp.parallel.reading.forward_graph import (ForwardUnreadable, is_projection, products, read_forward,
                                                          sources, widths_of)
from lightning_amp.parallel.reading.heads import attention_unit

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


def accepted(path: str, unsplit_ok: Sequence[str]) -> Optional[str]:
    """The first glob of ``unsplit_ok`` that matches ``path`` or a module above it, or None."""
    parts = path.split(".")
    prefixes = [".".join(parts[:end]) for end in range(len(parts), 0, -1)]
    return next((glob for glob in unsplit_ok if any(fnmatch.fnmatchcase(p, glob) for p in prefixes)), None)


def unmatched_globs(model: nn.Module, unsplit_ok: Sequence[str]) -> list[str]:
    names = [name for name, _ in model.named_modules() if name]
    return [glob for glob in unsplit_ok if not any(fnmatch.fnmatchcase(name, glob) for name in names)]


def unsplit_problems(model: nn.Module, whole: dict[str, str], tp: int, unsplit_ok: Sequence[str]) -> list[str]:
    """One line per attention module of ``model`` with a projection in ``whole`` (path -> why it is left whole) that
    no glob of ``unsplit_ok`` accepts; the accepted ones get their reason in ``whole`` (updated in place)."""
    owners: dict[str, list[str]] = {}
    for path in whole:
        owner = _owner(model, path)
        if owner is not None:
            owners.setdefault(owner, []).append(path)
    problems = []
    for owner, layers in owners.items():
        reason = why_not_split(model, owner, tp)
        glob = accepted(owner, unsplit_ok)
        if glob is not None:
            for layer in layers:
                whole[layer] = f"attention {owner} left whole as unsplit_ok={glob!r} allows: {reason}"
            continue
        problems.append(f"{type(model).__name__}: the attention {owner} ({type(model.get_submodule(owner)).__name__}) "
                        f"would be left whole on every rank ({', '.join(layers)}): {reason}. {_way_out(model, owner)}")
    return problems


def why_not_split(model: nn.Module, path: str, tp: int) -> str:
    """What reading the attention module ``path`` alone shows: why its heads are not split at TP size ``tp``."""
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
    unit = attention_unit(model, members, outs[0], tp)
    return unit.problem or "its attention was read but left out of the plan"


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
