"""Nothing is left half-split in silence: an attention ``plan="auto"`` cannot split is refused at setup, before
anything changes, naming the model, the module path, the reason read from that module itself and what to pass
instead; ``unsplit_ok=[globs]`` (validated when the options are built) keeps it whole on purpose, with the reason in
the plan report. Attentions written here to be unreadable (``transformers`` BLOOM and MPT, refused before, are split
now: tests/parallel/test_fused_layouts_tp.py): one whose forward fx cannot read (a loop over a data-dependent count)
and one whose scores come from ``torch.einsum``, a product the reading does not know; and an MLP with a residual
inside its two layers,
refused under the names the plan knows (``fc1``/``fc2``) as under any other (issue 48: it was split and crashed with a
size mismatch at the first forward)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_amp.parallel import TensorParallelConfig
from lightning_amp.parallel.plan import build_plan
from lightning_amp.trainer.strategy import TensorParallelStrategy
from lightning_amp.fabric import TensorParallelStrategy as FabricTensorParallelStrategy

V, H = 64, 32


def _refused(model: nn.Module, tp: int = 2, **kwargs) -> str:
    before = copy.deepcopy(model.state_dict())
    kinds = [type(m) for m in model.modules()]
    with pytest.raises(ValueError) as info:
        build_plan(model, "auto", tp, **kwargs)
    assert [type(m) for m in model.modules()] == kinds  # nothing was changed
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return str(info.value)


class UnreadableAttention(nn.Module):
    """A fused blocked ``Wqkv`` whose forward loops over a count read from the data: fx cannot read it."""

    def __init__(self, dim: int = H, heads: int = 4) -> None:
        super().__init__()
        self.n_heads = heads
        self.Wqkv, self.out_proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.Wqkv(x).view(b, t, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        for _ in range(torch.nonzero(x[0, :, 0] > 0).shape[0]):
            q = q * 1.0
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1))


class ScoresByEinsum(nn.Module):
    """Fused per-head ``query_key_value``, scores by ``torch.einsum`` (no product the reading knows)."""

    def __init__(self, dim: int = H, heads: int = 4) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.query_key_value, self.dense = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.query_key_value(x).view(b, t, self.num_heads, 3, self.head_dim)
        q, k, v = (qkv[..., i, :] for i in range(3))
        weights = torch.einsum("bqhd,bkhd->bhqk", q, k).softmax(-1)
        return self.dense(torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, attention=ScoresByEinsum, name: str = "self_attention") -> None:
        super().__init__()
        self.name = name
        setattr(self, name, attention())
        self.mlp = nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H))

    def forward(self, x):
        x = x + getattr(self, self.name)(x)
        return x + self.mlp(x)


def unreadable() -> nn.Module:
    return nn.Sequential(Block(UnreadableAttention, "attn"), Block(UnreadableAttention, "attn"))


def test_an_attention_fx_cannot_read_is_refused_with_its_own_reason_and_the_way_out():
    message = _refused(unreadable())
    assert "Sequential: the attention 0.attn (UnreadableAttention) would be left whole on every rank (0.attn.Wqkv, " \
           "0.attn.out_proj)" in message, message
    assert "torch.fx cannot read its forward" in message  # its own reason, not its parent's
    assert "Its Wqkv is a fused projection" in message
    assert "unsplit_ok=['*.attn']" in message
    assert "1.attn" in message  # every block's attention is named


def test_unsplit_ok_keeps_the_named_attentions_whole_with_the_reason_in_the_plan():
    model = unreadable()
    plan = build_plan(model, "auto", 2, unsplit_ok=["*.attn"])
    assert sorted(u.family for u in plan.units) == ["nn.Sequential MLP"] * 2  # the MLPs are still split
    why = plan.whole["0.attn.Wqkv"]
    assert why.startswith("attention 0.attn left whole as unsplit_ok='*.attn' allows: torch.fx cannot read its "
                          "forward"), why
    # a glob accepting block 0 only: block 1 is still refused
    message = _refused(model, unsplit_ok=["0.attn"])
    assert "1.attn (UnreadableAttention)" in message and "0.attn (" not in message
    assert "unsplit_ok: 'blocks.*.attn' matches no module of Sequential" in _refused(model, unsplit_ok=["blocks.*.attn"])


def test_an_attention_without_a_product_the_reading_knows_is_refused_with_the_plan_that_splits_it():
    model = nn.Sequential(Block(), Block())
    message = _refused(model)
    assert "Sequential: the attention 0.self_attention (ScoresByEinsum) would be left whole on every rank " \
           "(0.self_attention.query_key_value, 0.self_attention.dense): its forward, read alone, shows no attention " \
           "product" in message, message
    assert "unsplit_ok=['*.self_attention']" in message
    plan = build_plan(model, "auto", 2, unsplit_ok=["*.self_attention"])
    assert [u.family for u in plan.units] == ["nn.Sequential MLP"] * 2  # the MLPs are split
    build_plan(model, "auto", 1)  # tp=1 divides nothing: nothing is refused
    lone = nn.Sequential(ScoresByEinsum())
    assert "would be left whole" in _refused(lone)
    assert build_plan(lone, "auto", 2, allow_replicated=True).units == []  # the whole model replicated on purpose


class SeparateButUnread(nn.Module):
    """q, k, v, o projections whose product (``torch.einsum``) the reading does not know: the plan naming them."""

    def __init__(self, dim: int = H, heads: int = 4) -> None:
        super().__init__()
        self.num_heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.num_heads, -1) for p in (self.q, self.k, self.v))
        weights = torch.einsum("bqhd,bkhd->bhqk", q, k).softmax(-1)
        return self.o(torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, -1))


def test_separate_projections_are_refused_with_the_explicit_plan_that_splits_them():
    message = _refused(nn.ModuleList([SeparateButUnread()]))
    assert ("pass plan={'*.q': 'column', '*.k': 'column', '*.v': 'column', '*.o': 'row'}" in message), message


@pytest.mark.parametrize("bad, error, words", [
    ("layers.*.attn", TypeError, "unsplit_ok must be a list of module path globs"),
    ([3], TypeError, "unsplit_ok must be a list of module path globs"),
    ([" "], ValueError, "unsplit_ok: ' ' is not a module path glob"),
])
def test_unsplit_ok_is_checked_when_the_options_are_built(bad, error, words):
    for build in (TensorParallelConfig, TensorParallelStrategy, FabricTensorParallelStrategy):
        with pytest.raises(error, match=words):
            build(unsplit_ok=bad)
    assert TensorParallelConfig(unsplit_ok=["a.*", "b"]).unsplit_ok == ("a.*", "b")
    assert TensorParallelStrategy(unsplit_ok=["h.*.attn"]).config.unsplit_ok == ("h.*.attn",)


# ------------------------------------------------------------------ issue 48: a residual inside an MLP

class ResidualMLP(nn.Module):
    """``fc2(gelu(fc1(x)) + x)``: the residual adds the full ``x`` to a shard of fc1's output."""

    def __init__(self, names=("fc1", "fc2")) -> None:
        super().__init__()
        self.names = names
        for name in names:
            setattr(self, name, nn.Linear(H, H))

    def forward(self, x):
        up, down = (getattr(self, n) for n in self.names)
        return down(F.gelu(up(x)) + x)


@pytest.mark.parametrize("names", [("fc1", "fc2"), ("w1", "w2"), ("expand", "shrink")])
def test_an_mlp_with_a_residual_between_its_layers_is_refused_under_any_names(names):
    model = nn.Sequential(ResidualMLP(names))
    message = _refused(model)
    assert f"0.{names[0]}" in message, message
    x = torch.randn(2, 5, H)
    assert model(x).shape == x.shape  # the model itself runs: the refusal is the plan's


def test_the_strategies_config_carries_unsplit_ok_to_the_conversion():
    """What the strategies' setup calls (``convert_model`` with their config), as rank 0 of 2: refused without
    ``unsplit_ok``, converted with it, the reason in the report."""
    from lightning_amp.parallel.layers import RowParallelLinear
    from lightning_amp.parallel.convert import convert_model
    from support.simulated_ranks import as_rank

    config = TensorParallelStrategy(unsplit_ok=["*.attn"]).config
    with as_rank(0, 2):
        with pytest.raises(ValueError, match="unsplit_ok=\\['\\*.attn'\\]"):
            convert_model(unreadable(), None, TensorParallelConfig())
        model = unreadable()
        report = convert_model(model, None, config)
    assert sum(isinstance(m, RowParallelLinear) for m in model.modules()) == 2  # the MLPs
    assert "left whole as unsplit_ok=" in report.format()
