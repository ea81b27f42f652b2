"""The head layout of a fused ``[q | k | v]`` projection: counts and the split rules, no tensors.

What the reading of a model (:mod:`~lightning_amp.parallel.reading.families`, :mod:`~lightning_amp.parallel.reading.heads`)
finds and what the layer that splits the weight (:mod:`~lightning_amp.parallel.fused_qkv`) is built from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class QKVHeads:
    """The head layout of a fused ``[q | k | v]`` weight."""

    n_head: int
    n_query_groups: int
    head_size: int

    @property
    def blocks(self) -> tuple[int, int, int]:
        kv = self.n_query_groups * self.head_size
        return (self.n_head * self.head_size, kv, kv)

    def problem(self, tp: int) -> Optional[str]:
        """Why these heads cannot be split over ``tp`` ranks, or None."""
        if self.n_head % tp:
            return f"n_head={self.n_head} not divisible by tensor_parallel_size={tp}"
        if self.n_query_groups % tp and tp % self.n_query_groups:
            return (f"n_query_groups={self.n_query_groups} neither divisible by tensor_parallel_size={tp} nor "
                    f"dividing it (so each rank's {self.n_head // tp} query heads cannot get whole key/value heads, "
                    "split or replicated)")
        return None

    def replicated(self, tp: int) -> bool:
        """Whether the key/value heads are replicated (fewer of them than ranks)."""
        return self.n_query_groups % tp != 0

    def local(self, tp: int) -> "QKVHeads":
        """The heads one rank computes."""
        return QKVHeads(self.n_head // tp, max(self.n_query_groups // tp, 1), self.head_size)
