"""An attention found by structure whose heads cannot be split is refused by name with the reason and the counts,
before anything changes: head counts neither divisible by the TP size nor (key/value) dividing it, a head count
written as a literal in the forward, a per-head tensor, a norm over the whole projection output before the heads are
split; and what is left whole is said with its reason. The plan report names how each unit was found."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_amp.parallel.plan import build_plan
from support import torchtitan_llama as tt
from support.simulated_ranks import simulate


def _refused(model: nn.Module, tp: int) -> str:
    before = copy.deepcopy(model.state_dict())
    kinds = [type(m) for m in model.modules()]
    attrs = {n: dict(vars(m)) for n, m in model.named_modules()}
    with pytest.raises(ValueError) as info:
        build_plan(model, "auto", tp)
    assert [type(m) for m in model.modules()] == kinds  # nothing was changed
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert {n: {k: v for k, v in vars(m).items()} for n, m in model.named_modules()} == attrs
    return str(info.value)


class Attention(nn.Module):
    """q, k, v and out projections with arbitrary names; ``variant`` picks what its forward does wrong."""

    def __init__(self, variant: str = "", heads: int = 4, dim: int = 32) -> None:
        super().__init__()
        self.variant, self.heads = variant, heads
        self.a, self.b, self.c, self.d = (nn.Linear(dim, dim) for _ in range(4))
        self.scale = nn.Parameter(torch.rand(1, heads, 1, 1) + 0.5)  # one per head
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        n, t, _ = x.shape
        q = self.a(x)
        if self.variant == "norm before heads":  # a norm over all heads' features (OLMo2's q_norm)
            q = self.norm(q)
        heads = 4 if self.variant == "literal" else self.heads
        q, k, v = (y.view(n, t, heads, -1).transpose(1, 2) for y in (q, self.b(x), self.c(x)))
        if self.variant == "per-head scale":
            q = q * self.scale
        return self.d(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, t, -1))


def test_head_counts_neither_divisible_nor_replicable_are_refused_with_the_counts():
    model = tt.Transformer(tt.ModelArgs(dim=48, n_heads=6, n_kv_heads=3, n_layers=1))
    message = _refused(model, 2)
    assert "layers.0.attention.wq, layers.0.attention.wk, layers.0.attention.wv, layers.0.attention.wo (attention)" in message
    assert "3 key/value heads neither divisible by tensor_parallel_size=2 nor dividing it" in message
    assert "6 query heads not divisible by tensor_parallel_size=4" in _refused(model, 4)


@pytest.mark.parametrize("variant, reason", [
    ("literal", "read as one rank, the query, key and value reach the attention product with [4, 4, 4] heads, not "
                "[2, 2, 2]"),  # view(n, t, 4, -1): four heads of half the size
    ("per-head scale", "no per-rank value of the attributes its forward reads for its reshapes (heads=4) gives one "
                       "rank's heads their shapes"),
    ("norm before heads", "norm acts on the whole output of a before it is split into heads"),
])
def test_an_attention_whose_heads_cannot_be_read_is_refused_by_name(variant, reason):
    message = _refused(nn.Sequential(Attention(variant)), 2)
    assert "0.a, 0.b, 0.c, 0.d (attention)" in message and reason in message, message
    if variant == "per-head scale":
        assert "; with heads=2: read as one rank, mul fails: " in message
    assert build_plan(nn.Sequential(Attention()), "auto", 2).units[0].head_values == {("0", ("heads",)): 2}


def test_the_report_says_how_each_unit_was_found_and_why_layers_stay_whole():
    """At tp=2, rank 0 of the issue's model: attention (structure) with its per-rank heads and attribute, MLP (the
    w1/w3 -> w2 names), the vocabulary head left whole with its reason."""
    torch.manual_seed(0)
    model = tt.Transformer(tt.ModelArgs(n_heads=4, n_kv_heads=1, n_layers=1, meta_attention=True))
    _, report, _, _ = simulate(model, lambda m: torch.zeros(()), 2)
    text = report.format()
    assert text.startswith("tp_fused plan at tensor_parallel_size=2: 2 unit(s) split, 1 layer(s) left whole")
    assert ("  attention (found by structure): 4 query heads of 8, 2 per rank; 1 key/value head(s) replicated, "
            "1 used per rank") in text
    assert "layers.0.attention.wk     Linear     replicated 1 head(s) of 8 replicated, head 0 used" in text
    assert "per rank: layers.0.attention.n_local_heads 4 -> 2, layers.0.attention.n_rep 4 -> 2" in text
    assert "  named MLP (found by names)" in text
    assert "    output: its output leaves the model with no layer after it to take a shard" in text
