"""The plan report: what ``tp_fused`` split, how each unit was found, and what it left whole and why.

:class:`PlanReport` is what :func:`~lightning_amp.parallel.plan.convert_model` returns; the strategies print it at
setup on rank 0 (:meth:`PlanReport.format`) and keep it as ``strategy.plan_report``.
"""
from __future__ import annotations

from dataclasses import dataclass, field


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
