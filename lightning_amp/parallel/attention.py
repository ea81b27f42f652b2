"""ParallelMultiheadAttention: a tensor-parallel drop-in for ``nn.MultiheadAttention``.

Heads are split over the TP group: q/k/v projections are ColumnParallelLinear (this rank's
``num_heads / tp`` heads, sliced from MHA's fused ``in_proj_weight``), attention runs on the
local heads with ``scaled_dot_product_attention``, and ``out_proj`` is a RowParallelLinear.
Forward takes MHA's arguments and returns ``(output, None)`` (attention weights are not
materialised). With ``sequence_parallel`` the query (and, unless ``kv_sequence_parallel=False`` as
for a decoder's cross-attention on a full ``memory``, key/value) arrive split along the sequence
and the output leaves split along it (Megatron). ``full_state()`` gives the gathered params in MHA's original key layout.
``**linear_kwargs`` (normally ``config=TensorParallelConfig(...)``) go to the four projections.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_amp.parallel.groups import group_rank, group_size
from lightning_amp.parallel.layers import ColumnParallelLinear, RowParallelLinear


class ParallelMultiheadAttention(nn.Module):
    # attributes nn.Transformer* probe for their inference fast path; None/False disables it
    in_proj_weight = None
    in_proj_bias = None
    _qkv_same_embed_dim = False

    def __init__(
        self,
        mha: nn.MultiheadAttention,
        group: Optional[Any] = None,
        sequence_parallel: bool = False,
        kv_sequence_parallel: Optional[bool] = None,
        **linear_kwargs,
    ) -> None:
        super().__init__()
        tp = group_size(group)
        if mha.num_heads % tp != 0:
            raise ValueError(
                f"MultiheadAttention: num_heads={mha.num_heads} is not divisible by tensor_parallel_size={tp}"
            )
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError("MultiheadAttention with add_bias_kv=True or add_zero_attn=True cannot be tensor-parallel")
        self.group, self.tp_size, self.tp_rank = group, tp, group_rank(group)
        self.embed_dim, self.num_heads = mha.embed_dim, mha.num_heads
        self.head_dim = mha.head_dim
        self.local_heads = mha.num_heads // tp
        self.batch_first, self.dropout = mha.batch_first, mha.dropout
        self.fused_in_proj = mha._qkv_same_embed_dim
        if self.fused_in_proj:
            wq, wk, wv = mha.in_proj_weight.detach().chunk(3, dim=0)
        else:
            wq, wk, wv = (mha.q_proj_weight.detach(), mha.k_proj_weight.detach(), mha.v_proj_weight.detach())
        bq = bk = bv = None
        if mha.in_proj_bias is not None:
            bq, bk, bv = mha.in_proj_bias.detach().chunk(3)
        kv_sp = sequence_parallel if kv_sequence_parallel is None else kv_sequence_parallel
        self.sequence_parallel, self.kv_sequence_parallel = sequence_parallel, kv_sp
        # projections see batch-first tensors (see forward): the sequence dim is 1
        col = dict(linear_kwargs, gather_output=False, sequence_dim=1)
        self.q_proj = ColumnParallelLinear.from_weights(wq, bq, group, sequence_parallel=sequence_parallel, **col)
        self.k_proj = ColumnParallelLinear.from_weights(wk, bk, group, sequence_parallel=kv_sp, **col)
        self.v_proj = ColumnParallelLinear.from_weights(wv, bv, group, sequence_parallel=kv_sp, **col)
        self.out_proj = RowParallelLinear.from_linear(
            mha.out_proj, group, input_is_parallel=True, sequence_parallel=sequence_parallel, sequence_dim=1, **linear_kwargs
        )

    def _heads(self, x: Tensor) -> Tensor:
        n, length, _ = x.shape
        return x.view(n, length, self.local_heads, self.head_dim).transpose(1, 2)

    def _mask(self, attn_mask, key_padding_mask, n, q_len, k_len, dtype, device) -> Optional[Tensor]:
        mask = None
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                attn_mask = torch.zeros(attn_mask.shape, dtype=dtype, device=device).masked_fill(attn_mask, float("-inf"))
            attn_mask = attn_mask.to(dtype)
            if attn_mask.dim() == 3:  # [N * H, L, S]: keep this rank's heads
                attn_mask = attn_mask.view(n, self.num_heads, q_len, k_len)
                lo = self.tp_rank * self.local_heads
                attn_mask = attn_mask[:, lo:lo + self.local_heads]
            mask = attn_mask
        if key_padding_mask is not None:
            if key_padding_mask.dtype == torch.bool:
                kpm = torch.zeros(key_padding_mask.shape, dtype=dtype, device=device).masked_fill(key_padding_mask, float("-inf"))
            else:
                kpm = key_padding_mask.to(dtype)
            kpm = kpm.view(n, 1, 1, k_len)
            mask = kpm if mask is None else mask + kpm
        return mask

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        q, k, v = self._heads(self.q_proj(query)), self._heads(self.k_proj(key)), self._heads(self.v_proj(value))
        n, q_len, k_len = q.shape[0], q.shape[2], k.shape[2]  # full lengths (sequence-parallel inputs are gathered)
        mask = self._mask(attn_mask, key_padding_mask, n, q_len, k_len, q.dtype, q.device)
        ctx = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=bool(is_causal) and mask is None,
        )
        ctx = ctx.transpose(1, 2).reshape(n, q_len, self.local_heads * self.head_dim)
        out = self.out_proj(ctx)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, None

    def full_state(self) -> dict[str, Tensor]:
        """Gathered params under ``nn.MultiheadAttention``'s state_dict keys (collective over the TP group)."""
        wq, wk, wv = (p.full_weight() for p in (self.q_proj, self.k_proj, self.v_proj))
        state = {}
        if self.fused_in_proj:
            state["in_proj_weight"] = torch.cat([wq, wk, wv], 0)
        else:
            state.update(q_proj_weight=wq, k_proj_weight=wk, v_proj_weight=wv)
        if self.q_proj.bias is not None:
            state["in_proj_bias"] = torch.cat([p.full_bias() for p in (self.q_proj, self.k_proj, self.v_proj)], 0)
        state["out_proj.weight"] = self.out_proj.full_weight()
        if self.out_proj.bias is not None:
            state["out_proj.bias"] = self.out_proj.full_bias()
        return state

    def replacement_params(self, key: str) -> list[nn.Parameter]:
        """The params that now hold what ``nn.MultiheadAttention``'s param ``key`` held (``out_proj.*`` kept
        their names and are not asked for)."""
        projections = {"in_proj_weight": "qkv", "q_proj_weight": "q", "k_proj_weight": "k", "v_proj_weight": "v"}
        if key in projections and (key == "in_proj_weight") == self.fused_in_proj:
            return [getattr(self, f"{name}_proj").weight for name in projections[key]]
        if key == "in_proj_bias" and self.q_proj.bias is not None:
            return [proj.bias for proj in (self.q_proj, self.k_proj, self.v_proj)]
        raise KeyError(key)

    def load_full_state(self, state: dict[str, Tensor]) -> None:
        """Take this rank's slices from a full state in MHA's key layout."""
        if self.fused_in_proj:
            wq, wk, wv = state["in_proj_weight"].chunk(3, 0)
        else:
            wq, wk, wv = state["q_proj_weight"], state["k_proj_weight"], state["v_proj_weight"]
        biases = state["in_proj_bias"].chunk(3) if "in_proj_bias" in state else (None, None, None)
        for proj, w, b in zip((self.q_proj, self.k_proj, self.v_proj), (wq, wk, wv), biases):
            proj.load_full_state({"weight": w, **({"bias": b} if b is not None else {})})
        out = {"weight": state["out_proj.weight"]}
        if "out_proj.bias" in state:
            out["bias"] = state["out_proj.bias"]
        self.out_proj.load_full_state(out)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads} ({self.local_heads}/rank), tp={self.tp_size}"
