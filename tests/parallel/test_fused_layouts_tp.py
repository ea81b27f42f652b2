"""Fused in-projections split by what the forward does with their output, on ``transformers`` models nobody here
wrote (tests/support/fused_families.py, random init, no downloads): Phi-3 (``qkv_proj`` cut ``[q | k | v]`` by
indexing, GQA; ``gate_up_proj`` chunked ``[gate | up]``), GPT-NeoX (``query_key_value`` interleaved per head), Falcon
with one key/value head (replicated on both ranks) and with its new decoder architecture (interleaved per key/value
group), BLOOM (``query_key_value`` interleaved per head, scores ``alibi.baddbmm(q, k)`` with the heads folded into the
batch, the ALiBi bias built for all heads outside the attention) and MPT (blocked ``Wqkv``, ALiBi ``position_bias``
built outside). Each has its attention and its MLP split in every block (each rank's weights of the planned shapes);
on 2 gloo ranks at fp32 every step's loss equals the single process's (1e-5 relative), and the gathered checkpoint
loads strictly into the plain model and equals the single process's. Phi-3's fused GQA at tensor_parallel_size=4 (4
gloo ranks): tests/parallel/test_torchtitan_tp.py (its 4-rank job).

A wrong cut of the ALiBi bias (another rank's heads, or none) fails the one-process check of every rank's shard
against the whole attention (``test_alibi_attentions_every_rank_against_the_whole``) by O(1)."""
from __future__ import annotations

import json

import pytest
import torch

from lightning_amp.parallel.plan import build_plan
from lightning_amp.trainer.strategy import TensorParallelStrategy
from support.bounds import gamma
from support.fused_families import assert_split_as_planned, build
from support.families_zoo import STEPS, Zoo, fit, needs_transformers, rel_loss_diff, state_diff
from support.optional_deps import require
from support.simulated_ranks import backward, grad_errors, simulate

SPLIT = ("phi3", "neox", "falcon_mq", "falcon_new", "bloom", "mpt")
#: per family, per block: its attention's layout as the reading found it
LAYOUTS = {"phi3": "blocks", "neox": "groups", "falcon_mq": "blocks", "falcon_new": "groups", "bloom": "groups",
           "mpt": "blocks"}
#: per family, the inputs of its attention's forward cut to each rank's heads
HEAD_INPUTS = {"bloom": {"alibi", "attention_mask"}, "mpt": {"position_bias"}}


@needs_transformers
@pytest.mark.parametrize("name", SPLIT)
def test_each_block_splits_its_attention_and_its_mlp(name):
    model = build(name)
    plan = build_plan(model, "auto", 2)
    attention = [u for u in plan.units if u.family == "attention"]
    mlps = [u for u in plan.units if "MLP" in u.family]
    assert len(attention) == len(mlps) == 2, [(u.family, u.members) for u in plan.units]
    assert {u.attention_shape.layout for u in attention} == {LAYOUTS[name]}
    assert list(plan.whole) == ["lm_head"], plan.whole
    if name == "phi3":  # each rank holds matching gate and up rows: the fused [gate | up] split block by block
        assert all(u.chunks == {u.columns[0]: 2} for u in mlps)
    if name == "falcon_mq":  # one key/value head, 2 ranks: kept whole on both, 2 of the 4 query heads each
        assert all(u.attention_shape.replicated(2) for u in attention)
    if name in HEAD_INPUTS:  # ALiBi (and the masks) cut to each rank's heads
        assert all({i.name for inputs in u.head_inputs.values() for i in inputs} == HEAD_INPUTS[name]
                   for u in attention), [u.head_inputs for u in attention]


@pytest.mark.slow
@needs_transformers
def test_fused_families_tp2_match_single_device(tmp_path):
    ref, _ = fit(tmp_path / "single", "auto", 1, names=SPLIT)
    tp2, _ = fit(tmp_path / "tp2", TensorParallelStrategy(start_method="spawn"), 2, names=SPLIT)
    with open(tmp_path / "tp2" / "converted.json") as f:
        converted = json.load(f)
    for name, (columns, rows) in converted.items():  # attention and MLP in each of the 2 blocks
        assert columns >= 4 and rows == 4, f"{name}: {columns} column- and {rows} row-parallel layers at TP=2"
    with open(tmp_path / "tp2" / "local_shapes.json") as f:
        shapes = json.load(f)
    for name in SPLIT:  # attention and MLP of each block, of the planned shapes
        assert_split_as_planned(shapes[name], name, 2)
    ref_state = torch.load(tmp_path / "single" / "final.ckpt", weights_only=False)["state_dict"]
    tp_state = torch.load(tmp_path / "tp2" / "final.ckpt", weights_only=False)["state_dict"]
    Zoo(names=SPLIT).load_state_dict(tp_state)  # strict: the plain model's keys and shapes
    diffs = {}
    for name in SPLIT:
        assert len(tp2[name]) == len(ref[name]) == STEPS and ref[name][-1] < ref[name][0], (name, ref[name])
        diffs[name] = (rel_loss_diff(tp2[name], ref[name]), state_diff(tp_state, ref_state, f"families.{name}."))
        assert diffs[name][0] < 1e-5, f"{name}: TP=2 {tp2[name]} vs one process {ref[name]}"
        assert diffs[name][1] < 1e-5, f"{name}: the checkpoints differ by {diffs[name][1]:.2e}"
    print("\nfamily: max rel loss diff, max ckpt diff (rel. to max |w|)\n" +
          "\n".join(f"  {n}: {a:.2e} {b:.2e}" for n, (a, b) in diffs.items()))


def _alibi_attention(family: str, heads: int):
    """A ``transformers`` ALiBi attention (hidden 64, random init, float64), its ALiBi bias and causal mask built as
    its model builds them, and how to call it (residual zero and out-projection bias zero: the ranks' outputs sum)."""
    require("transformers")
    import transformers as t
    from transformers.models.bloom import modeling_bloom as bloom
    from transformers.models.mpt import modeling_mpt as mpt

    seq = 5
    torch.manual_seed(0)
    if family == "bloom":
        attn = bloom.BloomAttention(t.BloomConfig(hidden_size=64, n_head=heads, attention_dropout=0.0), layer_idx=0)
        torch.nn.init.zeros_(attn.dense.bias)
        padded = torch.tensor([[1] * seq, [0, 0] + [1] * (seq - 2)])  # each batch entry its own ALiBi rows
        alibi = bloom.build_alibi_tensor(padded, heads, torch.float64)
        mask = torch.triu(torch.full((seq, seq), -1e9, dtype=torch.float64), 1)[None, None]
        return attn.double(), lambda m, x: m(x, torch.zeros_like(x), alibi, mask)[0]  # alibi passed by position
    attn = mpt.MptAttention(t.MptConfig(d_model=64, n_heads=heads, max_seq_len=seq), layer_idx=0)
    bias = mpt.build_mpt_alibi_tensor(heads, seq).double()
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]
    return attn.double(), lambda m, x: m(x, position_bias=bias, attention_mask=mask)[0]


@pytest.mark.parametrize("family", ["bloom", "mpt"])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_alibi_attentions_every_rank_against_the_whole(family, tp):
    """Each rank's shard of BLOOM's and MPT's attention (8 heads, each its own ALiBi slope), run as that rank in one
    process, summed, against the whole attention in float64 (tests/support/simulated_ranks.py): the output and every
    gradient within gamma_64 of fp32 (measured: <= 6e-16)."""
    full, run = _alibi_attention(family, 8)
    x = torch.randn(2, 5, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    want = run(full, x)
    grad = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    want.backward(grad)
    _, report, ranks, total = simulate(full, lambda m: run(m, x), tp)
    backward(total, grad, tp)
    assert ((total - want).abs().max() / want.abs().max()).item() < gamma(64)
    errors = grad_errors(full, ranks)
    assert errors and max(errors.values()) < gamma(64), errors
    (split,) = report.split
    assert f"input(s) {', '.join(sorted(HEAD_INPUTS[family]))} cut to each rank's heads" in split.heads, split.heads
