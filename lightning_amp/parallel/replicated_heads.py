"""A key or value projection with fewer heads than tensor-parallel ranks, kept whole on every rank (Megatron's
GQA/MQA layout for separate ``k``/``v`` projections; :mod:`~lightning_amp.parallel.fused_qkv` does the same for a
fused ``[q | k | v]``).

With ``n_heads`` key/value heads and ``tp`` ranks, ``tp % n_heads == 0``: the query heads are split in consecutive
blocks, so rank ``r``'s query heads all use key/value head ``g = r // (tp / n_heads)``. Every rank holds the whole
weight (small) and computes only head ``g``: ``x @ W[g]^T + b[g]``, ``head_size`` features. The weight's gradient,
partial on each rank (its queries only; zero for the heads it does not use), is summed over the TP group inside
backward, so every rank holds the full gradient and the replicated weights stay equal under any optimizer: they
are ordinary replicated params (``tensor_model_parallel = False``, ``grad_reduced_over_tp = True``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_amp.parallel import comm
from lightning_amp.parallel.fused_qkv import _replicated, head_used
from lightning_amp.parallel.groups import group_rank, group_size


class ReplicatedHeadsLinear(nn.Module):
    """The whole projection ``weight`` ``[n_heads * head_size, in]`` (``[in, out]`` when ``transposed``, as
    ``transformers``' ``Conv1D``) and ``bias`` on every rank; forward returns this rank's head (see the module
    docstring). ``sequence_parallel``: ``x`` arrives split along ``sequence_dim`` and is gathered here."""

    gather_output = False  # the output is this rank's head (what sequence.py's guard looks for)

    def __init__(self, weight: Tensor, bias: Optional[Tensor], n_heads: int, head_size: int, group: Any = None,
                 sequence_parallel: bool = False, sequence_dim: int = 0, transposed: bool = False, **_layer_options) -> None:
        super().__init__()
        tp = group_size(group)
        full = weight.t() if transposed else weight
        if full.shape[0] != n_heads * head_size:
            raise ValueError(f"ReplicatedHeadsLinear: {full.shape[0]} outputs are not {n_heads} heads of {head_size}")
        if tp % n_heads:
            raise ValueError(f"ReplicatedHeadsLinear: {n_heads} heads cannot be replicated over tensor_parallel_size={tp} "
                             "(it must be a multiple of them); split them instead")
        self.group, self.tp_size, self.transposed = group, tp, transposed
        self.n_heads, self.head_size = n_heads, head_size
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.in_features, self.out_features = full.shape[1], full.shape[0]
        self.head = head_used(group_rank(group), tp, n_heads)
        self.shared_input = None  # as ColumnParallelLinear's
        self.weight = _replicated(full)
        self.bias = None if bias is None else _replicated(bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.shared_input is not None and not comm.tracing():  # the unit's one input collective (comm.SharedInput)
            x = self.shared_input(x)
        elif self.sequence_parallel:
            x = comm.gather_from_sequence_parallel_region(x, self.group, self.sequence_dim)
        else:
            x = comm.copy_to_tensor_parallel_region(x, self.group)  # partial input grads summed over TP
        # used by every rank for its own head: identity forward, the weight's grads summed over TP in backward
        weight = comm.copy_to_tensor_parallel_region(self.weight, self.group)
        rows = slice(self.head * self.head_size, (self.head + 1) * self.head_size)
        bias = None if self.bias is None else comm.copy_to_tensor_parallel_region(self.bias, self.group)[rows]
        return F.linear(x, weight[rows], bias)

    def full_state(self) -> dict:
        """``weight``/``bias`` in the original module's layout (every rank holds them whole)."""
        weight = self.weight.detach()
        state = {"weight": weight.t().contiguous() if self.transposed else weight}
        if self.bias is not None:
            state["bias"] = self.bias.detach()
        return state

    def load_full_state(self, state: dict) -> None:
        with torch.no_grad():
            self.weight.copy_(state["weight"].t() if self.transposed else state["weight"])
            if self.bias is not None:
                self.bias.copy_(state["bias"])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} ({self.n_heads} heads of "
                f"{self.head_size}, replicated), tp={self.tp_size}, head {self.head} used")
