"""tp_fused on model families nobody here wrote (tiny, randomly initialised, no downloads): ``transformers``
BERT, RoBERTa, GPT-2 (Conv1D, fused QKV), Llama and Mistral (GQA), Lightning's demo ``nn.Transformer``, and BERT,
GPT-2 and Llama with their layers and head attributes renamed (tests/support/renamed.py: no name the plan knows is
left, so their attention and MLPs are found by structure).

One LightningModule holds every family and trains them side by side (the loss is their sum; their params
are disjoint, so each family trains exactly as it would alone). On 2 real gloo ranks at TP=2 each family's
per-step loss must equal the single-device run's and the gathered checkpoint must equal the single-device
checkpoint; the checkpoint taken mid-run resumes at TP=2 and at TP=1 onto the uninterrupted run. Plan
validation (what is refused, before anything changes) is checked in-process.
"""
import json

import pytest
import torch
from torch import nn

from lightning_amp.parallel.layers import ColumnParallelLinear, RowParallelLinear
from lightning_amp.parallel.plan import build_plan
from lightning_amp.trainer.strategy import TensorParallelStrategy
from support.families_zoo import (FAMILIES, FFN, HF, HIDDEN, LAYERS, MIDWAY, RENAMED, STEPS, VOCAB, Zoo, fit,
                                  hf_models, needs_transformers, rel_loss_diff, state_diff)

@pytest.mark.slow
@needs_transformers
def test_families_tp2_match_single_device_checkpoints_and_resume(tmp_path):
    ref, _ = fit(tmp_path / "single", "auto", 1)
    tp2, returned = fit(tmp_path / "tp2", TensorParallelStrategy(start_method="spawn"), 2)
    with open(tmp_path / "tp2" / "converted.json") as f:
        converted = json.load(f)
    assert set(converted) == set(FAMILIES)
    for name, (columns, rows) in converted.items():  # else the equality below proves nothing for it
        assert columns > 0 and rows > 0, f"{name}: {columns} column- and {rows} row-parallel layers at TP=2"
    for name in RENAMED:  # found by structure: as many layers split as under the names the plan knows
        assert converted[name] == converted[name.removesuffix("_renamed")], (name, converted)
    ref_state = torch.load(tmp_path / "single" / "final.ckpt", weights_only=False)["state_dict"]
    tp_state = torch.load(tmp_path / "tp2" / "final.ckpt", weights_only=False)["state_dict"]
    assert set(tp_state) == set(ref_state)  # the original key layout (Conv1D, in_proj, head attrs untouched)
    plain = Zoo()
    plain.load_state_dict(tp_state)  # strict: loads into the unconverted model
    # the spawn launcher gathers the weights after teardown and loads them into the caller's (plain) module
    assert all(torch.equal(v, tp_state[k]) for k, v in returned.state_dict().items())
    report = {}
    for name in ref:
        assert len(tp2[name]) == len(ref[name]) == STEPS
        assert ref[name][-1] < ref[name][0], f"{name} did not train: {ref[name]}"
        loss_diff = rel_loss_diff(tp2[name], ref[name])
        ckpt_diff = state_diff(tp_state, ref_state, f"families.{name}.")
        report[name] = (loss_diff, ckpt_diff)
        assert loss_diff < 1e-5, f"{name}: TP=2 losses {tp2[name]} vs single device {ref[name]}"
        assert ckpt_diff < 1e-5, f"{name}: TP=2 checkpoint differs from single device by {ckpt_diff:.2e}"
    print("\nfamily: max rel loss diff, max ckpt diff (rel. to max |w|)\n" +
          "\n".join(f"  {n}: {a:.2e} {b:.2e}" for n, (a, b) in report.items()))

    # the midway checkpoint resumes onto the uninterrupted run: at TP=2, and resharded at TP=1
    midway = str(tmp_path / "tp2" / "midway.ckpt")
    resumed_tp2, _ = fit(tmp_path / "resume_tp2", TensorParallelStrategy(start_method="spawn"), 2, ckpt_path=midway)
    resumed_tp1, model = fit(tmp_path / "resume_tp1", "tp_fused", 1, ckpt_path=midway)
    assert isinstance(model.families["gpt2"].transformer.h[0].attn.c_attn, ColumnParallelLinear)
    for run in ("resume_tp2", "resume_tp1"):
        state = torch.load(tmp_path / run / "final.ckpt", weights_only=False)["state_dict"]
        losses = resumed_tp2 if run == "resume_tp2" else resumed_tp1
        for name in ref:
            assert rel_loss_diff(losses[name], ref[name][MIDWAY:]) < 1e-5, f"{run} {name}: {losses[name]}"
            assert state_diff(state, ref_state, f"families.{name}.") < 1e-5, f"{run} {name}"


def _o2_trains(tmp_path, names):
    from lightning_amp.trainer.precision import AmpO2Precision

    losses, _ = fit(tmp_path / "o2", TensorParallelStrategy(start_method="spawn"), 2, names=names,
                    plugins=[AmpO2Precision(dtype="bfloat16")])
    assert set(losses) == set(names)
    for name, values in losses.items():
        assert len(values) == STEPS and all(torch.isfinite(torch.tensor(values))), f"{name}: {values}"
        assert values[-1] < values[0], f"{name} did not train under O2 bf16: {values}"


@pytest.mark.slow
@needs_transformers
def test_transformers_families_tp2_bf16_o2_train(tmp_path):
    """TP=2 with AmpO2Precision(bfloat16): every ``transformers`` family trains (finite losses that fall)."""
    _o2_trains(tmp_path, HF)


@pytest.mark.slow
def test_demo_transformer_tp2_bf16_o2_trains(tmp_path):
    _o2_trains(tmp_path, ("demo",))


# ------------------------------------------------------------------ the plan, validated before anything changes


def _names(units, kind):
    return sorted(n for u in units for n in getattr(u, kind))


@needs_transformers
def test_auto_plan_finds_each_family_layout():
    models = hf_models()
    bert = build_plan(models["bert"], "auto", 2).units
    assert {u.family for u in bert} == {"BERT attention", "BERT MLP"}
    layer = "bert.encoder.layer.0."
    assert {f"{layer}attention.self.{n}" for n in ("query", "key", "value")} <= set(_names(bert, "columns"))
    assert {f"{layer}attention.output.dense", f"{layer}output.dense"} <= set(_names(bert, "rows"))
    assert f"{layer}intermediate.dense" in _names(bert, "columns")
    gpt2 = {u.members[0]: u for u in build_plan(models["gpt2"], "auto", 2).units}
    assert gpt2["transformer.h.0.attn.c_attn"].chunks == {"transformer.h.0.attn.c_attn": 3}
    assert gpt2["transformer.h.0.mlp.c_fc"].transposed == {"transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"}
    llama = build_plan(models["llama"], "auto", 2).units
    assert _names(llama, "rows") == sorted(f"model.layers.{i}.{n}" for i in range(LAYERS) for n in ("self_attn.o_proj", "mlp.down_proj"))
    for name in RENAMED:  # the same units, every one found by structure, under the new names
        plain, renamed = build_plan(models[name.removesuffix("_renamed")], "auto", 2), build_plan(models[name], "auto", 2)
        assert {u.found_by for u in renamed.units} == {"structure"}
        assert len(renamed.units) == len(plain.units) == 2 * LAYERS and not set(renamed.decisions) & set(plain.decisions)
        assert sorted(len(u.columns) for u in renamed.units) == sorted(len(u.columns) for u in plain.units)
    gpt2_attn = [u for u in build_plan(models["gpt2_renamed"], "auto", 2).units if u.family == "attention"]
    assert gpt2_attn[0].head_values == {("transformer.h.0.attn", ("width",)): HIDDEN // 2}  # its split_size


@needs_transformers
def test_plan_refuses_what_cannot_be_split_and_changes_nothing():
    from transformers import LlamaConfig, LlamaForCausalLM

    gqa = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=1, num_attention_heads=6,
                                       num_key_value_heads=3, intermediate_size=FFN))
    before = {k: v.clone() for k, v in gqa.state_dict().items()}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn .*: 3 key/value heads neither divisible by "
                                         r"tensor_parallel_size=2 nor dividing it"):
        build_plan(gqa, "auto", 2)
    bert = hf_models()["bert"]
    with pytest.raises(ValueError, match=r"bert\.encoder\.layer\.0\.attention\.self\.num_attention_heads=4 not divisible by tensor_parallel_size=8"):
        build_plan(bert, "auto", 8)
    # an explicit plan whose row layer would get a full key/value where it expects shards
    with pytest.raises(ValueError, match=r"attention\.self\.key \(column\)"):
        build_plan(bert, {"*.attention.self.query": "column", "*.attention.output.dense": "row"}, 2)
    assert all(torch.equal(before[k], v) for k, v in gqa.state_dict().items())
    assert not any(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in gqa.modules())


def test_plan_refuses_plain_torch_layouts_it_cannot_split():
    with pytest.raises(ValueError, match=r"\['1'\] belong to a nn.Sequential MLP unit .*'0 \(column\)'"):
        build_plan(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)), {"1": "row"}, 2)
    with pytest.raises(ValueError, match=r"row-parallel \['2'\] in 'the model' have no column-parallel partner"):
        build_plan(nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 4)), {"2": "row"}, 2)
    # nothing to split: refused unless training replicated is asked for
    convs = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten())
    with pytest.raises(ValueError, match="allow_replicated=True"):
        build_plan(convs, "auto", 2)
    assert build_plan(convs, "auto", 2, allow_replicated=True).units == []
    assert build_plan(convs, "auto", 1).units == []  # TP=1: pure data parallel, nothing to split is fine
