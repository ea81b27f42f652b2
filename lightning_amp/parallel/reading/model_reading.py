"""``plan="auto"``: the units of a model, found by its layout's names where they are known, by structure otherwise.

In order: the known families of :mod:`~lightning_amp.parallel.reading.families` (a fast path on types and child names:
``nn.MultiheadAttention``, ``nn.Transformer*Layer``, BERT, GPT-2, litgpt, named and ``nn.Sequential`` MLPs); then
:mod:`~lightning_amp.parallel.reading.structure` reads the forward of what is left and finds attention blocks and MLPs by
what they compute, whatever they are called; last, for modules whose forward ``torch.fx`` cannot read at all, the
Llama-style ``q_proj``/``k_proj``/``v_proj``/``o_proj`` names (:data:`~lightning_amp.parallel.reading.families.FALLBACK_MATCHERS`).
Every projection left whole has its reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from lightning_amp.parallel.reading.families import FALLBACK_MATCHERS, Unit, find_units
from lightning_amp.parallel.reading.structure import find_structural_units


@dataclass
class AutoUnits:
    """The units ``plan="auto"`` found, and per projection left whole, why."""

    units: list[Unit] = field(default_factory=list)
    whole: dict[str, str] = field(default_factory=dict)


def auto_units(module: nn.Module, tp: int) -> AutoUnits:
    """The units of ``module`` at tensor-parallel size ``tp`` (see the module docstring); changes nothing."""
    units = find_units(module)
    claimed = {m for u in units for m in u.members}
    structural = find_structural_units(module, claimed, tp)
    units += structural.units
    claimed |= {m for u in structural.units for m in u.members}
    unread = claimed | structural.seen  # the names fall back only where no reading showed the layers
    fallback = [u for u in find_units(module, FALLBACK_MATCHERS, claimed=unread)]
    units += fallback
    claimed |= {m for u in fallback for m in u.members}
    order = {name: i for i, (name, _) in enumerate(module.named_modules())}
    units.sort(key=lambda u: min(order[m] for m in u.members))  # the model's order, top to bottom
    inside = tuple(f"{name}." for name in claimed)  # an nn.MultiheadAttention's out_proj is converted with it
    return AutoUnits(units, {path: why for path, why in structural.whole.items()
                             if path not in claimed and not path.startswith(inside)})
