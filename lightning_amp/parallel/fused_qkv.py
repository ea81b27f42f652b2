"""Projections split by heads where key/value heads may be fewer than ranks: a fused ``[q | k | v]`` projection with
grouped key/value heads (litgpt's ``attn.qkv``), and separate key/value projections kept whole on every rank.

The full weight is three row blocks: ``q`` (``n_head * head_size`` rows, heads in order), ``k`` and ``v``
(``n_query_groups * head_size`` rows each); query head ``h`` attends with key/value head
``h // (n_head / n_query_groups)``. Each rank keeps ``n_head / tp`` consecutive query heads and the
key/value heads they use, and outputs ``[q_r | k_r | v_r]``: the layout the attention's own code splits
with the *per-rank* head counts (:meth:`QKVHeads.local`).

* ``n_query_groups`` divisible by the TP size: every block is split by heads
  (a :class:`ColumnParallelLinear` with ``blocks=(q, k, v)``).
* fewer key/value heads than ranks (GQA with few groups, MQA) and ``tp % n_query_groups == 0``: as
  Megatron does, the key/value heads are *replicated*: :class:`ReplicatedKVColumnParallel` keeps the query
  rows split and the whole (small) key/value block on every rank, each rank using its heads' group. The
  key/value weight's gradient, partial per rank (each rank's queries only), is all-reduced over the TP
  group inside backward, so every rank holds the full gradient and the replicated weights stay equal
  under any optimizer; they are ordinary replicated params (``tensor_model_parallel = False``).

Separate ``k``/``v`` projections with ``n_heads`` key/value heads, fewer than the ``tp`` ranks (``tp % n_heads ==
0``): :class:`ReplicatedHeadsLinear`. The query heads are split in consecutive blocks, so rank ``r``'s query heads all
use key/value head ``g = r // (tp / n_heads)``. Every rank holds the whole weight (small) and computes only head
``g``: ``x @ W[g]^T + b[g]``, ``head_size`` features. The weight's gradient, partial on each rank (its queries only;
zero for the heads it does not use), is summed over the TP group inside backward, as for the fused layout.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_amp.parallel import comm
from lightning_amp.parallel.groups import group_rank, group_size
from lightning_amp.parallel.layers import ColumnParallelLinear
from lightning_amp.parallel.reading.qkv_heads import QKVHeads


def head_used(rank: int, tp: int, n_heads: int) -> int:
    """The key/value head rank ``rank`` of ``tp`` uses when ``n_heads`` of them are replicated (``tp % n_heads == 0``):
    its query heads are the ``rank``-th of ``tp`` equal consecutive blocks, each inside one group of
    ``n_query_heads / n_heads`` query heads that share a key/value head."""
    return rank // (tp // n_heads)


class ReplicatedKVColumnParallel(nn.Module):
    """``[q_r | k_g | v_g]`` of a fused ``[q | k | v]`` Linear: the query rows split over the TP group
    (a :class:`ColumnParallelLinear`, ``self.q``), the key/value rows whole on every rank (``self.kv_weight``,
    ``self.kv_bias``), of which rank ``r`` uses key/value head ``g = r // (tp / n_query_groups)``.
    ``sequence_parallel``: ``x`` arrives split along ``sequence_dim`` (gathered here, reduce-scattered in
    backward), as for a :class:`ColumnParallelLinear`."""

    gather_output = False  # the output is this rank's heads (what sequence.py's guard looks for)

    def __init__(self, weight: Tensor, bias: Optional[Tensor], heads: QKVHeads, group: Any = None,
                 sequence_parallel: bool = False, sequence_dim: int = 0, **linear_kwargs) -> None:
        super().__init__()
        tp = group_size(group)
        if heads.problem(tp) or not heads.replicated(tp):
            raise ValueError(f"ReplicatedKVColumnParallel: {heads} at tensor_parallel_size={tp}: "
                             f"{heads.problem(tp) or 'key/value heads divide: split them instead'}")
        self.heads, self.group, self.tp_size = heads, group, tp
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        q_rows = heads.blocks[0]
        self.kv_weight = _replicated(weight[q_rows:])
        self.kv_bias = None if bias is None else _replicated(bias[q_rows:])
        self.group_index = head_used(group_rank(group), tp, heads.n_query_groups)
        self.q = ColumnParallelLinear.from_weights(
            weight[:q_rows], None if bias is None else bias[:q_rows], group, gather_output=False,
            sequence_parallel=sequence_parallel, sequence_dim=sequence_dim, **linear_kwargs)
        self.q.shared_input = comm.SharedInput(group, sequence_parallel, sequence_dim)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        q = self.q(x)
        if not comm.tracing():  # the query rows' input collective serves the key/value rows too (comm.SharedInput)
            x = self.q.shared_input(x)
        elif self.sequence_parallel:
            x = comm.gather_from_sequence_parallel_region(x, self.group, self.sequence_dim)
        else:
            x = comm.copy_to_tensor_parallel_region(x, self.group)
        # replicated on every rank, used for different outputs: identity forward, grads summed over TP in backward
        weight = comm.copy_to_tensor_parallel_region(self.kv_weight, self.group)
        bias = None if self.kv_bias is None else comm.copy_to_tensor_parallel_region(self.kv_bias, self.group)
        k, v = F.linear(x, weight, bias).chunk(2, dim=-1)
        size, g = self.heads.head_size, self.group_index
        return torch.cat([q, k[..., g * size:(g + 1) * size], v[..., g * size:(g + 1) * size]], dim=-1)

    def full_state(self) -> dict:
        """The gathered ``weight``/``bias`` in the fused ``[q | k | v]`` layout (collective over the TP group)."""
        state = {"weight": torch.cat([self.q.full_weight(), self.kv_weight.detach()])}
        if self.kv_bias is not None:
            state["bias"] = torch.cat([self.q.full_bias(), self.kv_bias.detach()])
        return state

    def replacement_params(self, key: str) -> list[nn.Parameter]:
        """The params that now hold what the fused Linear's param ``key`` (``"weight"``/``"bias"``) held."""
        if key not in ("weight", "bias") or (key == "bias" and self.kv_bias is None):
            raise KeyError(key)
        return [self.q.weight, self.kv_weight] if key == "weight" else [self.q.bias, self.kv_bias]

    def load_full_state(self, state: dict) -> None:
        """Copy this rank's query rows and the whole key/value rows of a full ``[q | k | v]`` state."""
        q_rows = self.heads.blocks[0]
        self.q.load_full_state({k: v[:q_rows] for k, v in state.items()})
        with torch.no_grad():
            self.kv_weight.copy_(state["weight"][q_rows:])
            if self.kv_bias is not None:
                self.kv_bias.copy_(state["bias"][q_rows:])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.heads}, tp={self.tp_size}, "
                f"key/value head {self.group_index} (replicated)")


def _replicated(tensor: Tensor) -> nn.Parameter:
    param = nn.Parameter(tensor.detach().clone())
    param.tensor_model_parallel = False
    param.grad_reduced_over_tp = True  # full on every rank after backward: no sequence-parallel all-reduce
    return param


def fused_qkv_parallel(weight: Tensor, bias: Optional[Tensor], heads: QKVHeads, group: Any = None,
                       transposed: bool = False, **linear_kwargs) -> nn.Module:
    """The tensor-parallel replacement of a fused ``[q | k | v]`` Linear with ``heads`` (see the module docstring);
    ``transposed``: the weight is stored ``[in, out]`` (``transformers``' ``Conv1D``; its key/value heads are split,
    never replicated)."""
    if heads.replicated(group_size(group)):
        if transposed:
            raise ValueError(f"fused_qkv_parallel: {heads} at tensor_parallel_size={group_size(group)}: the key/value "
                             "heads of a Conv1D [in, out] projection cannot be replicated")
        return ReplicatedKVColumnParallel(weight, bias, heads, group, **linear_kwargs)
    return ColumnParallelLinear.from_weights(weight, bias, group, blocks=heads.blocks, gather_output=False,
                                             transposed=transposed, **linear_kwargs)


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
