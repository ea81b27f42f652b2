"""Fused in-projections split by what the forward does with their output, on ``transformers`` models nobody here
wrote (tests/support/fused_families.py, random init, no downloads): Phi-3 (``qkv_proj`` cut ``[q | k | v]`` by
indexing, GQA; ``gate_up_proj`` chunked ``[gate | up]``), GPT-NeoX (``query_key_value`` interleaved per head), Falcon
with one key/value head (replicated on both ranks) and with its new decoder architecture (interleaved per key/value
group). Each has its attention and its MLP split in every block; on 2 gloo ranks at fp32 every step's loss equals
the single process's (1e-5 relative), and the gathered checkpoint loads strictly into the plain model and equals
the single process's."""
from __future__ import annotations

import json

import pytest
import torch

from lightning_amp.parallel.plan import build_plan
from lightning_amp.trainer.strategy import TensorParallelStrategy
from support.fused_families import build
from support.families_zoo import STEPS, Zoo, fit, needs_transformers, rel_loss_diff, state_diff

SPLIT = ("phi3", "neox", "falcon_mq", "falcon_new")
#: per family, per block: its attention's layout as the reading found it
LAYOUTS = {"phi3": "blocks", "neox": "groups", "falcon_mq": "blocks", "falcon_new": "groups"}


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


@pytest.mark.slow
@needs_transformers
def test_fused_families_tp2_match_single_device(tmp_path):
    ref, _ = fit(tmp_path / "single", "auto", 1, names=SPLIT)
    tp2, _ = fit(tmp_path / "tp2", TensorParallelStrategy(start_method="spawn"), 2, names=SPLIT)
    with open(tmp_path / "tp2" / "converted.json") as f:
        converted = json.load(f)
    for name, (columns, rows) in converted.items():  # attention and MLP in each of the 2 blocks
        assert columns >= 4 and rows == 4, f"{name}: {columns} column- and {rows} row-parallel layers at TP=2"
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
