"""The layers a plan splits, and a model's modules as a plan sees them.

A **projection** is a layer tensor parallelism splits by rows or columns: ``nn.Linear`` or ``transformers``' ``Conv1D``
(a Linear storing its weight ``[in, out]``) (:func:`is_projection`, :func:`is_conv1d`, :func:`widths_of`). The
**layer table** of a model (:func:`layer_table`) gives every module under it, by path, as a :class:`Layer`: what a plan
entry naming it may do, and its widths, so that a plan is checked without going back to the model.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn


def is_conv1d(module: nn.Module) -> bool:
    """``transformers``' ``Conv1D``: a Linear storing its weight as ``[in, out]`` (``nx``, ``nf``). Reads the module's
    dicts, not ``getattr``, which ``torch.fx`` replaces while it traces."""
    if type(module).__name__ != "Conv1D":
        return False
    weight = module._parameters.get("weight")
    return isinstance(vars(module).get("nf"), int) and weight is not None and tuple(weight.shape) == (module.nx, module.nf)


def is_projection(module: nn.Module) -> bool:
    """A layer the plan can split: ``nn.Linear`` or ``Conv1D``."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def widths_of(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a projection."""
    return (module.nx, module.nf) if is_conv1d(module) else (module.in_features, module.out_features)


@dataclass(frozen=True)
class Layer:
    """A module as a plan entry sees it: its class name and kind ("linear" | "conv1d": ``transformers``' ``Conv1D``,
    weight ``[in, out]`` | "attention": ``nn.MultiheadAttention`` | "other"), and for a projection its input and
    output features."""

    type_name: str
    kind: str
    in_features: int = 0
    out_features: int = 0

    @property
    def splits(self) -> bool:
        """Whether tp_fused can split it (a projection or an ``nn.MultiheadAttention``)."""
        return self.kind != "other"

    @property
    def projection(self) -> bool:
        return self.kind in ("linear", "conv1d")


def layer_table(module: nn.Module) -> dict[str, Layer]:
    """Every module under ``module`` (not itself) by path, in ``named_modules()`` order, as a :class:`Layer`."""
    table = {}
    for path, sub in module.named_modules():
        if not path:
            continue
        name = type(sub).__name__
        if isinstance(sub, nn.MultiheadAttention):
            table[path] = Layer(name, "attention")
        elif is_projection(sub):
            table[path] = Layer(name, "conv1d" if is_conv1d(sub) else "linear", *widths_of(sub))
        else:
            table[path] = Layer(name, "other")
    return table
