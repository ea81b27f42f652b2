"""A Llama written as Meta and torchtitan write it (tests/support/torchtitan_llama.py: wq/wk/wv/wo, w1/w3 -> w2,
-1 reshapes and repeat_kv, or Meta's n_local_heads reshapes and matmul/softmax), and the same with its attributes
renamed, under Fabric(strategy="tp_fused") on real gloo ranks, against one process: every Linear but the vocabulary
head split (the attention found by structure), MHA, GQA and MQA with key/value heads split and replicated at tp=2
(2 ranks) and tp=4 (4 ranks: 2 key/value groups replicated, where a rank that picks the wrong key/value head shows);
litgpt's fused [q | k | v] with 2 groups at tp=4 too (tests/support/scripts/litgpt_tp.py's loop), and ``transformers``
Phi-3's fused GQA ``qkv_proj`` at tp=4 (tests/support/fused_families.py: 4 query heads and 2 key/value heads, one query
head per rank and the key/value heads replicated; 8 and 4, split: 2 query heads and 1 key/value head per rank), its
attention and MLP split in every block with the planned per-rank weights. fp32: every step's loss
and every weight within 1e-5 relative of one process (measured: losses <= 1.2e-7, weights <= 2.2e-7); the gathered checkpoint loads strictly into the plain model,
which then computes the TP model's logits, and loads back into the TP model exactly; the plan report is logged once,
on rank 0, and kept as ``fabric.strategy.plan_report``. O2 (bf16) with the key/value head kept whole: within bf16
rounding of one process at O2."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from support.fused_families import assert_split_as_planned
from support.optional_deps import available
from support.processes import run_ranks
from support.scripts import torchtitan_tp as loop

ROOT = Path(__file__).resolve().parents[2]
TP2 = ["mha", "gqa", "mqa", "renamed_meta_gqa"]
O2 = ["mqa@O2"]  # the key/value head kept whole, under AmpO2 (bf16)
TP4 = (["gqa8", "gqa8_2", "mqa8", "renamed_meta_gqa8_2"] + (["litgpt:llama_gqa"] if available("litgpt") else [])
       + (["hf:phi3", "hf:phi3_gqa8"] if available("transformers") else []))  # fused GQA: kv replicated, kv split


def _launch(out: Path, names: list, world_size: int) -> dict:
    spec = [[name, dict(name=name.split("@")[0], devices=world_size, precision=_precision(name))] for name in names]
    run_ranks("torchtitan_tp", (out, json.dumps(spec)), world_size)
    return {(name, world_size): [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in range(world_size)]
            for name in names}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """{(run name, tp): [rank results]} of every run at tp=2 (2 ranks) and tp=4 (4 ranks), each job started once."""
    return {**_launch(tmp_path_factory.mktemp("tp2"), TP2 + O2, 2), **_launch(tmp_path_factory.mktemp("tp4"), TP4, 4)}


def _precision(name: str) -> str:
    return name.split("@")[1] if "@" in name else "32-true"


@functools.lru_cache(maxsize=None)
def _one(name: str) -> dict:
    """The same loop in this one process (Fabric on one CPU device, the plain model); ``name@O2``: at O2 (bf16)."""
    return loop.train(name.split("@")[0], precision=_precision(name))


def _relative(a: dict, b: dict) -> float:
    """Largest difference of any tensor, relative to that tensor's largest magnitude in ``b``."""
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)


RUN_IDS = [(n, 2) for n in TP2] + [(n, 4) for n in TP4]  # fp32
LOOP_IDS = [(n, t) for n, t in RUN_IDS if not n.startswith("litgpt")]  # this loop's models (litgpt's: its own test)
TITAN_IDS = [(n, t) for n, t in LOOP_IDS if not n.startswith("hf:")]
HF_IDS = [(n, t) for n, t in LOOP_IDS if n.startswith("hf:")]


@pytest.mark.slow
@pytest.mark.parametrize("name, tp", RUN_IDS, ids=[f"{n}-tp{t}" for n, t in RUN_IDS])
def test_fp32_matches_one_process_each_step(runs, name, tp):
    one, ranks = _one(name), runs[(name, tp)]
    first, last = one["weights"][0], one["weights"][-1]
    assert min((last[k] - first[k]).abs().max().item() for k in first) > 1e-4  # every tensor trained
    losses = [abs(a - b) / b for a, b in zip(ranks[0]["losses"], one["losses"])]
    weights = [_relative(a, b) for a, b in zip(ranks[0]["weights"], one["weights"])]
    print(f"\n{name} tp={tp}: max rel loss diff {max(losses):.1e}, max rel weight diff {max(weights):.1e}")
    assert len(losses) == len(weights) == len(one["losses"]) == loop.STEPS
    assert max(losses) < 1e-5 and max(weights) < 1e-5, (losses, weights)
    for other in ranks[1:]:  # the gathered weights: the same tensors on every rank
        assert _relative(other["weights"][-1], ranks[0]["weights"][-1]) == 0.0
    assert ((ranks[0]["probe"] - one["probe"]).abs().max() / one["probe"].abs().max()).item() < 1e-5


@pytest.mark.slow
def test_o2_matches_one_process_within_bf16_rounding(runs):
    """O2 (bf16 autocast, fp32 params) at TP=2 with the key/value head kept whole on both ranks, vs one process at O2:
    the row layers' partial sums are rounded to bf16 before their all-reduce, where one process rounds the whole sum
    once, so activations differ by a few bf16 ulps (2^-8 = 3.9e-3 relative each). Bound: each step's loss within 1e-3
    relative (a quarter ulp: the cross-entropy averages the logits' differences) and each tensor within 5% of how far
    it moved; a replicated key/value weight whose gradient was not summed over the ranks, or a shard that missed or
    doubled an update, would be ~50-100% off."""
    one, ranks = _one("mqa@O2"), runs[("mqa@O2", 2)]
    start, end = one["weights"][0], one["weights"][-1]
    for step in range(len(one["losses"])):
        assert abs(ranks[0]["losses"][step] - one["losses"][step]) / one["losses"][step] < 1e-3, step
    for key in end:
        moved = (end[key] - start[key]).abs().max().item()
        assert moved > 1e-4, key
        assert (ranks[0]["weights"][-1][key] - end[key]).abs().max().item() < 0.05 * moved, key
    assert _relative(ranks[1]["weights"][-1], ranks[0]["weights"][-1]) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("name, tp", TITAN_IDS, ids=[f"{n}-tp{t}" for n, t in TITAN_IDS])
def test_every_linear_but_the_vocabulary_head_is_split_and_reported(runs, name, tp):
    """The issue's model split only its feed-forward (6 of 14 Linear layers): now every attention too, found by
    structure whatever its layers are called; the report says so once, on rank 0, and names what stayed whole."""
    heads, kv, meta, renamed = loop.CONFIGS[name]
    ranks = runs[(name, tp)]
    report = ranks[0]["report"]
    families = sorted((family, how) for family, how, _, _ in report["units"])
    mlp = ("MLP", "structure") if renamed else ("named MLP", "names")  # w1/w3 -> w2: a name the fast path knows
    assert families == sorted([("attention", "structure"), mlp] * 2)
    assert sum(len(layers) for _, _, _, layers in report["units"]) == 14
    assert list(report["whole"]) == ["output"] and "leaves" in report["whole"]["output"]
    kv = kv or heads
    attention = [line for family, _, line, _ in report["units"] if family == "attention"]
    assert len(attention) == 2 and all(("replicated" in line) == (kv < tp) for line in attention)
    local = ranks[0]["local_shapes"]
    q = "layers.0.mix.alpha.weight" if renamed else "layers.0.attention.wq.weight"
    assert local[q][0] * tp == _one(name)["local_shapes"][q][0]
    assert [len(r["logged"]) for r in ranks] == [1] + [0] * (tp - 1)  # logged once, on rank 0
    assert ranks[0]["logged"][0].endswith(report["text"])
    if (name, tp) == ("gqa8_2", 4):  # the example of docs/tensor-parallel.md, as this run printed it
        assert report["text"] in (ROOT / "docs" / "tensor-parallel.md").read_text()
    if meta:  # its reshapes read n_local_heads / n_local_kv_heads: given one rank's values
        names = ("q_count", "kv_count") if renamed else ("n_local_heads", "n_local_kv_heads")
        changed = report["attributes"][0]
        assert changed[f"layers.0.{'mix' if renamed else 'attention'}.{names[0]}"] == (heads, heads // tp)


@pytest.mark.slow
@pytest.mark.parametrize("name, tp", HF_IDS, ids=[f"{n}-tp{t}" for n, t in HF_IDS])
def test_transformers_fused_gqa_splits_attention_and_mlp_of_every_block(runs, name, tp):
    local = runs[(name, tp)][0]["local_shapes"]
    shapes = {k.removeprefix("lm.").removesuffix(".weight"): v for k, v in local.items()
              if k.endswith((".weight", ".kv_weight"))}
    assert_split_as_planned(shapes, name[3:], tp)
    units = runs[(name, tp)][0]["report"]["units"]
    assert sorted("MLP" if "MLP" in family else family for family, _, _, _ in units) == ["MLP", "MLP", "attention",
                                                                                          "attention"], units


@pytest.mark.slow
@pytest.mark.parametrize("name, tp", LOOP_IDS, ids=[f"{n}-tp{t}" for n, t in LOOP_IDS])
def test_gathered_checkpoint_round_trip(runs, name, tp):
    """The gathered weights load strictly into the plain model, which computes the TP model's logits (fp32, 1e-5
    relative), and load back into the TP model: gathered again, the same tensors (litgpt's: test_litgpt_tp.py)."""
    rank0 = runs[(name, tp)][0]
    plain = loop.model(name)
    plain.load_state_dict(rank0["weights"][-1], strict=True)
    with torch.no_grad():
        out = plain(rank0["probe_tokens"])
    assert ((rank0["probe"] - out).abs().max() / out.abs().max()).item() < 1e-5
    for rank in runs[(name, tp)]:
        assert all(torch.equal(rank["reloaded"][k], v) for k, v in rank0["weights"][-1].items())
