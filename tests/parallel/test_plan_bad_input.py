"""Plans that would split a model wrongly are refused with a ValueError naming the layer and why, before anything
changes: a hand-written plan cutting a fused projection whose forward cannot be read, a plan naming a module that does
not exist, litgpt head counts that can be neither split nor replicated, and a whole-width op between an explicit
column/row pair whose names no family knows. A hand-written plan naming the layers of an attention the plan reads by
structure gets that attention's layout (split by heads, its head-count attribute per rank)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_amp.parallel.plan import build_plan
from support.optional_deps import require


def _refused(model: nn.Module, plan, tp: int = 2) -> str:
    before = copy.deepcopy(model.state_dict())
    kinds = [type(m) for m in model.modules()]
    with pytest.raises(ValueError) as info:
        build_plan(model, plan, tp)
    assert [type(m) for m in model.modules()] == kinds  # nothing was changed
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return str(info.value)


class FusedAttention(nn.Module):
    """One ``qkv`` Linear and an ``out`` projection, heads in a plain attribute no family reads."""

    def __init__(self, dim: int = 16, heads: int = 4):
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(x).chunk(3, dim=-1))
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1))


class Mixer(nn.Module):
    """``a`` -> ``ln`` (a LayerNorm over the whole hidden width) -> ``b``: names no family pattern matches."""

    def __init__(self):
        super().__init__()
        self.a, self.ln, self.b = nn.Linear(8, 32), nn.LayerNorm(32), nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(self.ln(self.a(x))))


class UnreadableFusedAttention(FusedAttention):
    """The same attention over each sequence in a Python loop: torch.fx cannot iterate over a tensor."""

    def forward(self, x):
        return torch.stack([super(UnreadableFusedAttention, self).forward(row[None])[0] for row in x])


def test_a_hand_written_plan_cutting_a_fused_projection_is_refused():
    """Before: accepted, and each rank got whole q rows and half the k rows (a contiguous half of [q | k | v]). Now
    the fused projection is split by heads where the forward can be read, refused where it cannot."""
    plan = {"0.qkv": "column", "0.out": "row"}
    (unit,) = build_plan(nn.Sequential(FusedAttention()), plan, 2).units
    assert (unit.family, unit.found_by, unit.qkv_heads["0.qkv"].blocks) == ("attention", "structure", (16, 16, 16))
    assert unit.head_values == {("0", ("heads",)): 2}  # view(b, t, self.heads, -1): half the heads per rank
    message = _refused(nn.Sequential(UnreadableFusedAttention()), plan)
    assert "0.qkv has 48 outputs but 0.out take(s) 16 inputs" in message and "[q | k | v]" in message
    gated = nn.Sequential(nn.Linear(8, 64), nn.SiLU(), nn.Linear(32, 8))  # [gate | up] fused: 64 -> 32
    assert "0 has 64 outputs but 2 take(s) 32 inputs" in _refused(gated, {"0": "column", "2": "row"})


def test_a_plan_naming_a_module_that_does_not_exist_is_refused():
    model = nn.Sequential(FusedAttention())
    message = _refused(model, {"0.qvk": "column", "0.qkv": "column"})
    assert "'0.qvk' matches no module of Sequential" in message and "'0.qkv'" in message  # a close name offered
    assert "matches no module" in _refused(model, {"layers.*.fc1": "replicate"})


class FunctionalNormMixer(nn.Module):
    """``a`` -> ``F.layer_norm`` over the whole hidden width -> ``b``: no norm module a structural check could see."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.b(F.layer_norm(torch.relu(self.a(x)), (32,)))


class HeadNormAttention(FusedAttention):
    """Separate q/k/v with a norm over each head's 4 features (qk-norm): legitimate under a split by heads."""

    def __init__(self):
        super().__init__()
        del self.qkv
        self.wq, self.wk, self.wv = (nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.wq, self.wk, self.wv))
        q, k = F.layer_norm(q, (4,)), F.layer_norm(k, (4,))
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1))


def test_a_whole_width_norm_between_an_explicit_pair_with_unknown_names_is_refused():
    """The names match no family, so only the explicit plan's own check sees the norm (the named-MLP tests of
    test_parallel_between.py never reach it): a LayerNorm module by structure, F.layer_norm along the traced
    data flow; a per-head norm inside a hand-planned attention stays accepted (read by structure: an attention)."""
    assert "ln (LayerNorm) normalises 32 features" in _refused(Mixer(), {"a": "column", "b": "row"})
    message = _refused(FunctionalNormMixer(), {"a": "column", "b": "row"})
    assert "layer_norm (call_function) normalises the 32 features a split, on the way to b" in message
    plan = {"0.w?": "column", "0.out": "row"}
    assert [u.family for u in build_plan(nn.Sequential(HeadNormAttention()), plan, 2).units] == ["attention"]


def test_litgpt_head_counts_that_can_be_neither_split_nor_replicated_are_refused():
    litgpt = require("litgpt")

    def gpt(**kw):
        return litgpt.GPT(litgpt.Config(n_layer=1, n_embd=48, vocab_size=64, padding_multiple=64, block_size=8, **kw))

    message = _refused(gpt(n_head=6, n_query_groups=3), "auto")
    assert "transformer.h.0.attn.qkv, transformer.h.0.attn.proj (litgpt attention): n_query_groups=3 neither divisible by tensor_parallel_size=2 nor dividing it" in message
    message = _refused(gpt(n_head=3), "auto", tp=2)
    assert "transformer.h.0.attn.qkv, transformer.h.0.attn.proj (litgpt attention): n_head=3 not divisible by tensor_parallel_size=2" in message
    # the same model at TP=2: the one key/value head replicated, both units accepted, the MLP traced by fx (no
    # structure-only fallback warning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        units = build_plan(gpt(n_head=2, n_query_groups=1, head_size=24), "auto", 2).units
    assert [u.family for u in units] == ["litgpt attention", "named MLP"]
    # the layers the old refusal advised naming, recognised as litgpt's attention unit (split by heads)
    plan = {"transformer.h.*.attn.qkv": "column", "transformer.h.*.attn.proj": "row"}
    (unit,) = build_plan(gpt(n_head=4, n_query_groups=2), plan, 2).units
    assert unit.family == "litgpt attention" and unit.head_config == "transformer.h.0.attn"
    swapped = {"transformer.h.*.attn.qkv": "row", "transformer.h.*.attn.proj": "column"}
    assert "litgpt attention unit" in _refused(gpt(n_head=4), swapped)
