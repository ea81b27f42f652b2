"""The model read once, as a value: everything a plan needs to know of it.

:func:`read_model` reads a model at a tensor-parallel size, changes nothing, and returns a :class:`ModelReading`:

* the **units** ``plan="auto"`` finds, in the model's order: first the known families of
  :mod:`~lightning_amp.parallel.reading.families` (a fast path on types and child names: ``nn.MultiheadAttention``,
  ``nn.Transformer*Layer``, BERT, GPT-2, litgpt, named and ``nn.Sequential`` MLPs); then
  :mod:`~lightning_amp.parallel.reading.structure` reads the forward of what is left and finds attention blocks and MLPs
  by what they compute, whatever they are called; last, for modules whose forward ``torch.fx`` cannot read at all, the
  Llama-style ``q_proj``/``k_proj``/``v_proj``/``o_proj`` names (:data:`~lightning_amp.parallel.reading.families.FALLBACK_MATCHERS`).
  A unit that cannot be split carries its ``problem``: heads that do not split over ``tp``, or a named MLP whose
  column -> row data flow is not elementwise (:mod:`~lightning_amp.parallel.reading.between`);
* per projection left whole, **why**;
* the **layers** a plan entry may name (every module path: its type and, for a projection, its widths);
* for every **attention module** with a projection left whole or in a unit that cannot be split, what reading it alone
  shows and the ``plan=`` or ``unsplit_ok=`` that would do otherwise (:mod:`~lightning_amp.parallel.reading.unsplit`).

:func:`~lightning_amp.parallel.plan.build_plan` decides on this value; only an explicit plan's own column -> row pairs
send it back to the model (:func:`~lightning_amp.parallel.reading.between.between_problem`), as the last check.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from lightning_amp.parallel.reading.between import between_problem
from lightning_amp.parallel.reading.families import FALLBACK_MATCHERS, Unit, find_units
from lightning_amp.parallel.reading.projections import Layer, layer_table
from lightning_amp.parallel.reading.structure import find_structural_units
from lightning_amp.parallel.reading.unsplit import WholeAttention, whole_attentions

#: families whose column -> row data flow the family's own code does not fix: the reading traces it
_FREE_FLOW = ("named MLP",)


@dataclass
class ModelReading:
    """What :func:`read_model` found (see the module docstring); module paths are relative to ``model``."""

    model: nn.Module = field(repr=False, compare=False)
    tp: int
    layers: dict[str, Layer]  # every module but the model itself (projections.layer_table)
    units: list[Unit] = field(default_factory=list)
    whole: dict[str, str] = field(default_factory=dict)
    attention_of: dict[str, str] = field(default_factory=dict)  # projection path -> its attention module
    whole_attentions: dict[str, WholeAttention] = field(default_factory=dict)  # attention path -> what reading shows

    @property
    def model_name(self) -> str:
        return type(self.model).__name__


def read_model(module: nn.Module, tp: int) -> ModelReading:
    """Read ``module`` at tensor-parallel size ``tp`` (see the module docstring); changes nothing."""
    layers = layer_table(module)
    units = find_units(module)
    claimed = {m for u in units for m in u.members}
    named_fallback = find_units(module, FALLBACK_MATCHERS, claimed=claimed)
    structural = find_structural_units(module, claimed, tp, layers)
    units += structural.units
    claimed |= {m for u in structural.units for m in u.members}
    unread = claimed | structural.seen  # the names fall back only where no reading showed the layers
    fallback = [u for u in named_fallback if not unread.intersection(u.members)]
    units += fallback
    claimed |= {m for u in fallback for m in u.members}
    order = {name: i for i, (name, _) in enumerate(module.named_modules())}
    units.sort(key=lambda u: min(order[m] for m in u.members))  # the model's order, top to bottom
    inside = tuple(f"{name}." for name in claimed)  # an nn.MultiheadAttention's out_proj is converted with it
    whole = {path: why for path, why in structural.whole.items() if path not in claimed and not path.startswith(inside)}
    for unit in units:
        if unit.problem is None:
            unit.problem = next(filter(None, (heads.problem(tp) for heads in unit.qkv_heads.values())), None)
        if unit.problem is None and unit.family in _FREE_FLOW and unit.columns and unit.rows:
            unit.problem = between_problem(module, unit.columns, unit.rows, layers[unit.columns[0]].out_features)
    problems = {m: u.problem for u in units if u.problem for m in u.members}
    attention_of, attentions = whole_attentions(module, list(whole) + list(problems), problems, claimed)
    return ModelReading(module, tp, layers, units, whole, attention_of, attentions)
