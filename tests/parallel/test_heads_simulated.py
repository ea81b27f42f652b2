"""Every head layout at every size it exists, up to tp=8, in one process (tests/support/simulated_ranks.py: each
rank's shard of the attention run as that rank, summed, against the unconverted attention): query heads split;
key/value heads split (their count divisible by tp) or replicated (tp a multiple of it: every rank keeps the
key/value head its queries use, rank r the head r // (tp / n_kv)); for attentions nobody here wrote, found by
structure: torchtitan's and Meta's Llama attention, litgpt's fused [q | k | v] (also with per-head q/k norms),
transformers' LlamaAttention (with and without an attention mask: its forward repeats the key/value heads only with
a mask), and the same with their attributes renamed. A rank whose key/value head, shard or head-count attribute is
wrong is off by O(1).

Tolerance: torchtitan and Meta round q and k to fp32 for the rotary embedding (``.float()``), litgpt's RMSNorm
computes in fp32, so two float64 computations that sum in different orders may round differently there; the rest is
float64. Bound: gamma_64 in fp32 (64 roundings of 2^-24: 3.8e-6) relative to the largest element, for the output and
every gradient (measured: <= 5.0e-8 torchtitan and Meta, <= 4.4e-7 litgpt, <= 1.6e-15 transformers' Llama)."""
from __future__ import annotations

import pytest
import torch

from lightning_amp.parallel.plan import build_plan
from support import torchtitan_llama as tt
from support.bounds import gamma
from support.optional_deps import require
from support.renamed import rename_instances
from support.simulated_ranks import backward, grad_errors, simulate

TOLERANCE = gamma(64)
DIM, HEADS, SEQ = 64, 16, 5
KV_SIZES = [(kv, tp) for kv in (16, 8, 4, 2, 1) for tp in (2, 4, 8)]


def _check(full, inputs, run, tp, n_kv):
    """Simulate ``full`` at ``tp``; returns the plan report after checking output, input grad and every param grad."""
    full = full.double()
    x = torch.randn(2, SEQ, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    want = run(full, x, *inputs)
    grad = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    want.backward(grad)
    want_x, x.grad = x.grad.clone(), None
    plan, report, ranks, total = simulate(full, lambda m: run(m, x, *inputs), tp)
    backward(total, grad, tp)
    assert ((total - want).abs().max() / want.abs().max()).item() < TOLERANCE
    assert ((x.grad - want_x).abs().max() / want_x.abs().max()).item() < TOLERANCE
    errors = grad_errors(full, ranks)
    assert set(errors) == {n for n, p in full.named_parameters()}, "every param compared"
    assert max(errors.values()) < TOLERANCE, errors
    (unit,) = [u for u in report.split if "attention" in u.family]
    assert ("replicated" in unit.heads) == (n_kv < tp), unit.heads
    return report


def _torchtitan(kv, meta=False):
    torch.manual_seed(0)
    args = tt.ModelArgs(dim=DIM, n_heads=HEADS, n_kv_heads=kv, meta_attention=meta)
    return (tt.MetaAttention if meta else tt.Attention)(args), (tt.precompute_freqs_cis(DIM // HEADS, 16).to(torch.complex128),)


TITAN_NAMES = {"wq": "to_query", "wk": "to_key", "wv": "to_value", "wo": "mixer", "n_rep": "shared", "head_dim": "hd",
               "n_local_heads": "a", "n_local_kv_heads": "b", "n_heads": "c", "n_kv_heads": "d"}


@pytest.mark.parametrize("kv, tp, meta", [(kv, tp, False) for kv, tp in KV_SIZES] +
                         [(kv, tp, True) for kv, tp in KV_SIZES if kv in (8, 2)],
                         ids=[f"torchtitan-{kv}-{tp}" for kv, tp in KV_SIZES] +
                             [f"meta-{kv}-{tp}" for kv, tp in KV_SIZES if kv in (8, 2)])
def test_torchtitan_and_meta_llama_attention(kv, tp, meta):
    """torchtitan infers the local head counts from the projections (-1) and repeats the key/value heads n_rep times;
    Meta's reshapes with n_local_heads / n_local_kv_heads: the attributes the forward reads are given one rank's
    values (n_rep = local query heads / local key/value heads)."""
    full, inputs = _torchtitan(kv, meta)
    report = _check(full, inputs, lambda m, x, f: m(x, f), tp, kv)
    changed = report.split[0].attributes
    rep = (HEADS // tp) // (1 if kv < tp else kv // tp)
    if rep != HEADS // kv:
        assert changed["n_rep"] == (HEADS // kv, rep)
    if meta:
        assert changed["n_local_heads"] == (HEADS, HEADS // tp)


@pytest.mark.parametrize("kv, tp", [(4, 8), (2, 4), (8, 2)])
def test_renamed_torchtitan_attention_is_found_by_structure(kv, tp):
    for meta in (False, True):
        full, inputs = _torchtitan(kv, meta)
        rename_instances(full, type(full), TITAN_NAMES)
        assert not any(n.startswith(("wq", "wk", "wv", "wo")) for n, _ in full.named_parameters())
        report = _check(full, inputs, lambda m, x, f: m(x, f), tp, kv)
        assert report.split[0].found_by == "structure"


def _litgpt(kv, norm_qk=False):
    litgpt = require("litgpt")
    from litgpt.model import CausalSelfAttention, build_rope_cache

    config = litgpt.Config(n_embd=DIM, n_head=HEADS, n_query_groups=kv, n_layer=1, block_size=16, bias=False,
                           attn_bias=True, norm_qk=norm_qk, norm_class_name="RMSNorm")
    torch.manual_seed(0)
    attn = CausalSelfAttention(config, block_idx=0)
    if norm_qk:  # not ones: a gradient summed wrongly over the ranks must show
        with torch.no_grad():
            for norm in (attn.norm_q, attn.norm_k):
                norm.weight.uniform_(0.5, 1.5)
    cos, sin = build_rope_cache(SEQ, n_elem=config.rope_n_elem)
    return attn, (cos[None].double(), sin[None].double())


@pytest.mark.parametrize("kv, tp", [(kv, tp) for kv, tp in KV_SIZES if kv < 16])
def test_litgpt_fused_qkv(kv, tp):
    full, inputs = _litgpt(kv)
    report = _check(full, inputs, lambda m, x, cos, sin: m(x, cos, sin), tp, kv)
    assert report.split[0].family == "litgpt attention"


@pytest.mark.parametrize("kv, tp", [(2, 4), (8, 2), (2, 8)])
def test_litgpt_per_head_qk_norms_sum_their_gradients_over_the_ranks(kv, tp):
    """norm_qk: an RMSNorm over each head's features, applied to this rank's heads only: its weight's gradient is
    partial on each rank and summed over the group (without: one rank's share, 1/tp to 1/2 of it)."""
    full, inputs = _litgpt(kv, norm_qk=True)
    _check(full, inputs, lambda m, x, cos, sin: m(x, cos, sin), tp, kv)


@pytest.mark.parametrize("kv, tp", [(2, 4), (8, 8)])
def test_renamed_litgpt_attention_is_found_by_structure(kv, tp):
    """Its qkv, proj and config renamed: the fused layout read from the split, the head counts from the config
    fields the forward reads, on a per-rank copy of the config."""
    from litgpt.model import CausalSelfAttention

    full, inputs = _litgpt(kv)
    shared = full.config
    rename_instances(full, CausalSelfAttention, {"qkv": "mix_in", "proj": "mix_out", "config": "settings"})
    report = _check(full, inputs, lambda m, x, cos, sin: m(x, cos, sin), tp, kv)
    assert report.split[0].found_by == "structure"
    assert report.split[0].attributes["settings.n_head"] == (HEADS, HEADS // tp)
    assert shared.n_head == HEADS  # the config the model shares is not written


def test_a_renamed_litgpt_model_is_split_by_structure():
    """The whole GPT with its attention's and MLP's layers and config renamed: every block's attention and MLP
    found by structure (the names fast path finds none), the vocabulary head left whole."""
    litgpt = require("litgpt")
    from litgpt.model import CausalSelfAttention, LLaMAMLP

    config = litgpt.Config(n_layer=2, n_embd=DIM, n_head=HEADS, n_query_groups=2, vocab_size=64, block_size=16,
                           mlp_class_name="LLaMAMLP", intermediate_size=128, norm_class_name="RMSNorm")
    model = rename_instances(litgpt.GPT(config), CausalSelfAttention, {"qkv": "mix_in", "proj": "mix_out",
                                                                       "config": "settings"})
    rename_instances(model, LLaMAMLP, {"fc_1": "gate", "fc_2": "up", "proj": "down"})
    plan = build_plan(model, "auto", 4)
    assert [(u.family, u.found_by) for u in plan.units] == [("attention", "structure"), ("MLP", "structure")] * 2
    assert plan.units[0].qkv_heads["transformer.h.0.attn.mix_in"].n_query_groups == 2  # replicated at tp=4
    assert list(plan.whole) == ["lm_head"]


def _hf_llama(kv):
    require("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=DIM, num_attention_heads=HEADS, num_key_value_heads=kv, attn_implementation="sdpa")
    torch.manual_seed(0)
    attn = LlamaAttention(config, layer_idx=0)
    position = torch.arange(SEQ)[None]
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, SEQ, DIM), position)
    mask = torch.full((SEQ, SEQ), float("-inf")).triu(1)[None, None].double()
    return attn, ((cos.double(), sin.double()), mask)


@pytest.mark.parametrize("kv, tp", [(8, 2), (4, 4), (2, 4), (4, 8), (1, 8)])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
def test_transformers_llama_attention(kv, tp, masked):
    """With a mask, transformers' sdpa path repeats the key/value heads by num_key_value_groups: a replicated layout
    needs its per-rank value (local query heads / 1), found from the reading with the mask given."""
    full, (position, mask) = _hf_llama(kv)
    report = _check(full, (position, mask if masked else None), lambda m, x, p, a: m(x, p, a)[0], tp, kv)
    if kv < tp and HEADS // kv != HEADS // tp:
        assert report.split[0].attributes["num_key_value_groups"] == (HEADS // kv, HEADS // tp)


def test_renamed_transformers_llama_attention_is_found_by_structure():
    from transformers.models.llama.modeling_llama import LlamaAttention

    full, (position, mask) = _hf_llama(2)
    rename_instances(full, LlamaAttention, {"q_proj": "p1", "k_proj": "p2", "v_proj": "p3", "o_proj": "p4",
                                            "head_dim": "width", "scaling": "temperature"})
    report = _check(full, (position, mask), lambda m, x, p, a: m(x, p, a)[0], 8, 2)
    assert report.split[0].found_by == "structure"


class _WidthReadAttention(torch.nn.Module):
    """examples/bert_sentiment.py's attention: the head count read from the projection's output width
    (``t.shape[-1] // head_dim``), so each rank's forward finds its own heads; that read of the shape is no use of
    the projection's data and must not keep the output from being split."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head_dim = DIM // HEADS
        self.to_q, self.to_v = torch.nn.Linear(DIM, DIM), torch.nn.Linear(DIM, DIM)
        # no key bias (softmax cancels it: its gradient is rounding noise around 0, no relative error can be
        # compared), no out bias (the simulation sums the ranks' outputs)
        self.to_k, self.out = torch.nn.Linear(DIM, DIM, bias=False), torch.nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape

        def split_heads(t):
            return t.view(b, s, t.shape[-1] // self.head_dim, self.head_dim).transpose(1, 2)

        q, k, v = split_heads(self.to_q(x)), split_heads(self.to_k(x)), split_heads(self.to_v(x))
        context = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(context.transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_an_attention_that_reads_its_heads_from_the_projections_width(tp):
    report = _check(_WidthReadAttention(), (), lambda m, x: m(x), tp, HEADS)
    assert report.split[0].attributes == {}  # nothing to change: each rank reads its own width


def _fused(family: str, kv: int):
    """A fused-projection attention of ``transformers`` (random init, no biases: the ranks' outputs are summed), its
    rotary tables, and how to call it."""
    require("transformers")
    import transformers as t
    from transformers.models.falcon import modeling_falcon as falcon
    from transformers.models.gpt_neox import modeling_gpt_neox as neox
    from transformers.models.phi3 import modeling_phi3 as phi3

    common = dict(hidden_size=DIM, num_attention_heads=HEADS, attn_implementation="sdpa")
    torch.manual_seed(0)
    if family == "phi3":
        config = t.Phi3Config(**common, num_key_value_heads=kv, pad_token_id=0)
        attn, rotary = phi3.Phi3Attention(config, layer_idx=0), phi3.Phi3RotaryEmbedding(config)
        call = lambda m, x, p: m(x, position_embeddings=p, attention_mask=None)[0]  # noqa: E731
    elif family == "neox":
        config = t.GPTNeoXConfig(**common, attention_bias=False)
        attn, rotary = neox.GPTNeoXAttention(config, layer_idx=0), neox.GPTNeoXRotaryEmbedding(config)
        call = lambda m, x, p: m(x, attention_mask=None, position_embeddings=p)[0]  # noqa: E731
    else:
        config = t.FalconConfig(**common, bias=False, alibi=False, multi_query=kv == 1,
                                new_decoder_architecture=kv > 1, num_kv_heads=kv)
        attn, rotary = falcon.FalconAttention(config, layer_idx=0), falcon.FalconRotaryEmbedding(config)
        call = lambda m, x, p: m(x, None, None, position_embeddings=p)[0]  # noqa: E731
    cos, sin = rotary(torch.zeros(1, SEQ, DIM), torch.arange(SEQ)[None])
    return attn, ((cos.double(), sin.double()),), call


@pytest.mark.parametrize("family, kv, tp, layout", [
    ("phi3", 4, 2, "blocks"), ("phi3", 2, 4, "blocks"), ("phi3", 1, 8, "blocks"),  # GQA split; replicated at 4, 8
    ("neox", HEADS, 4, "groups"), ("neox", HEADS, 8, "groups"),  # interleaved per head
    ("falcon", 4, 4, "groups"), ("falcon", 2, 2, "groups"),  # interleaved per key/value group
    ("falcon", 1, 4, "blocks"),  # multi-query: the one key/value head replicated
])
def test_fused_transformers_attentions_every_rank_against_the_whole(family, kv, tp, layout):
    """Phi-3's [q | k | v] cut by indexing, GPT-NeoX's heads and Falcon's key/value groups interleaved, Falcon's
    multi-query view into heads: each rank's shard against the whole attention, up to tp=8."""
    full, inputs, call = _fused(family, kv)
    report = _check(full, inputs, call, tp, HEADS if family == "neox" else kv)
    assert report.split[0].found_by == "structure"
    assert build_plan(full, "auto", tp).units[0].attention_shape.layout == layout
