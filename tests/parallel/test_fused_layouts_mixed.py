"""The riskiest fused attention layouts under ``tp_fused`` with mixed precision, one step outside the fp32 tests of
tests/parallel/test_fused_layouts_tp.py: BLOOM (``query_key_value`` interleaved per head, ALiBi with the heads folded
into the batch, cut per rank), MPT (blocked ``Wqkv``, ALiBi ``position_bias`` cut per rank) and Falcon's new decoder
architecture (interleaved per key/value group) train on 2 gloo ranks under ``precision="bf16-mixed"`` and under
``AmpO2Plugin()`` (bf16), each against the same precision in one process; under O2 the checkpoint taken midway
resumes onto the uninterrupted TP=2 run exactly (losses and weights bit for bit). With sequence parallelism
(``sequence_dim=1``) BLOOM and MPT pass the same checks under O2, and Falcon (both variants, which add into a row
layer's output in place) under bf16-mixed.

Oracle and bounds (u = 2^-8, bf16's unit roundoff, :func:`support.bounds.unit_roundoff`). Both runs compute the same
bf16 ops; TP=2 rounds each row layer's partial sums to bf16 before their all-reduce, sums its input gradients across
ranks, and accumulates the weight gradients in an fp32 ``main_grad``, where one process rounds each whole sum once.
The runs therefore differ only by where and in which order bf16 rounds:

* **Each tensor's update** (its movement from the initial weights over STEPS SGD steps) agrees within
  ``UPDATE_TOL = 2 sqrt(n) u`` in norm, relative to the update's norm: the roundings of a step are independent with
  zero mean, so their effect on a tensor's many elements adds in quadrature (Higham, *Accuracy and Stability*, 2nd
  ed., sec. 2.8), ``sqrt(n) u`` for ``n`` bf16 roundings on the way from the loss to a weight's gradient (about 12
  per block in forward and as many in backward, 2 blocks: n = 48), twice for two runs: 5.4%. Measured
  (2026-11-29, Intel Xeon AVX-512, no AVX512_BF16/AMX): at most 1.5% (BLOOM's embedding LayerNorm weight under O2,
  a gradient that cancels across tokens; 2.2% with sequence parallelism), the split layers' weights at most 0.7%.
* **Each step's loss** agrees within ``u / 4`` relative (as tests/parallel/test_litgpt_tp.py bounds O2 at TP=2: the
  fp32 cross-entropy averages the logits' rounding differences over 64 tokens); measured at most 2.4e-4.

What a wrong split does, emulated in one process (each test reruns it and asserts it lies beyond ``2 UPDATE_TOL``,
so the update check is shown to catch it on the CPU it runs on): a wrong ALiBi cut (rank 0's heads' bias on both
ranks: heads 2 and 3 given the slopes of heads 0 and 1) changes the fused ``query_key_value``/``Wqkv`` update by 17%
(BLOOM) and 21% (MPT) of its norm, 3x and 4x ``UPDATE_TOL``; Falcon's query heads attending with the other key/value
group's keys and values (each rank cut the other's group), by 129%. A shard that missed or doubled its updates is
off by 100% (its whole movement). The loss is NOT the oracle for the split: these tiny random-init models barely use
their attention, and the same wrong cuts move the loss by at most 2.8e-6 (BLOOM), 6.2e-4 (MPT) and 2.8e-3 (Falcon)
at fp32, the first two below the loss bound, which catches NaN and divergence. Also: no NaN in any loss or weight,
the checkpoint gathered on the 2 ranks loads strictly into the plain model, attention and MLP are split in every
block, and after training every param and every ``main_grad`` is fp32 (the params both precisions promise:
Lightning's ``bf16-mixed`` and O2 keep the module's Parameters fp32)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from lightning_amp import AmpO2Plugin
from lightning_amp.trainer.strategy import TensorParallelStrategy
from support.bounds import unit_roundoff
from support.families_zoo import MIDWAY, STEPS, Zoo, fit, needs_transformers, rel_loss_diff

SPLIT = ("bloom", "mpt", "falcon_new")
PRECISIONS = {"bf16-mixed": lambda: dict(precision="bf16-mixed"), "O2": lambda: dict(plugins=[AmpO2Plugin()])}
U = unit_roundoff(torch.bfloat16)
ROUNDINGS = 48  # bf16 roundings from the loss to a weight's gradient: ~12 per block, forward and backward, 2 blocks
UPDATE_TOL = 2 * math.sqrt(ROUNDINGS) * U
LOSS_TOL = U / 4


def update_diffs(got: dict, ref: dict, start: dict, name: str) -> dict:
    """Per floating tensor of family ``name`` that moved: ``|got - ref| / |ref - start|`` (Frobenius norms)."""
    diffs = {}
    for key, initial in start.items():
        if key.startswith(f"families.{name}.") and initial.is_floating_point():
            moved = (ref[key].double() - initial.double()).norm()
            if moved > 0:
                diffs[key] = ((got[key].double() - ref[key].double()).norm() / moved).item()
    return diffs


def _wrong_cuts(monkeypatch) -> None:
    """In one process, what each family computes if its split took the wrong heads: BLOOM's and MPT's heads 2 and 3
    get the ALiBi slopes of heads 0 and 1 (of 4: both ranks took rank 0's cut of the bias); Falcon's query heads of
    key/value group 0 attend with group 1's keys and values and the reverse (each rank took the other's group)."""
    from transformers.models.bloom import modeling_bloom
    from transformers.models.falcon import modeling_falcon
    from transformers.models.mpt import modeling_mpt

    def first_half_twice(build):
        def wrong(*args, **kwargs):
            bias = build(*args, **kwargs).clone()  # heads first: BLOOM's slopes, MPT's (heads, 1, seq) bias
            bias[bias.shape[0] // 2:] = bias[:bias.shape[0] // 2]
            return bias
        return wrong

    def groups_swapped(split_heads):
        def wrong(self, fused_qkv):
            query, key, value = split_heads(self, fused_qkv)  # each (batch, seq, heads * head_dim), heads by group
            return query, *(x.unflatten(2, (self.num_kv_heads, -1)).flip(2).flatten(2) for x in (key, value))
        return wrong

    monkeypatch.setattr(modeling_bloom, "_get_alibi_slopes", first_half_twice(modeling_bloom._get_alibi_slopes))
    monkeypatch.setattr(modeling_mpt, "build_mpt_alibi_tensor", first_half_twice(modeling_mpt.build_mpt_alibi_tensor))
    monkeypatch.setattr(modeling_falcon.FalconAttention, "_split_heads",
                        groups_swapped(modeling_falcon.FalconAttention._split_heads))


def _tp2_against_one_process(out, precision: str, names: tuple, **strategy_kwargs):
    """Train ``names`` in one process and on 2 gloo ranks (``TensorParallelStrategy(**strategy_kwargs)``) under
    ``precision`` and check the TP=2 run against the one-process run as the module docstring says; returns the
    one-process run's final and the initial state dicts and, per family, (max rel loss diff, max update diff, its
    tensor)."""
    ref, _ = fit(out / "single", "auto", 1, names=names, **PRECISIONS[precision]())
    tp2, _ = fit(out / "tp2", TensorParallelStrategy(start_method="spawn", **strategy_kwargs), 2, names=names,
                 **PRECISIONS[precision]())
    with open(out / "tp2" / "converted.json") as f:
        for name, (columns, rows) in json.load(f).items():  # attention and MLP in each of the 2 blocks
            assert columns >= 4 and rows == 4, f"{name}: {columns} column- and {rows} row-parallel layers at TP=2"
    with open(out / "tp2" / "dtypes.json") as f:
        dtypes = json.load(f)
    start = Zoo(names=names).state_dict()
    ref_state, tp_state = (torch.load(out / run / "final.ckpt", weights_only=False)["state_dict"]
                           for run in ("single", "tp2"))
    Zoo(names=names).load_state_dict(tp_state)  # strict: the plain model's keys and shapes
    assert all(torch.isfinite(t).all() for t in tp_state.values() if t.is_floating_point())
    figures = {}
    for name in names:
        assert dtypes[name] == {"params": ["torch.float32"], "main_grad": ["torch.float32"]}, (name, dtypes[name])
        assert len(tp2[name]) == len(ref[name]) == STEPS and all(map(math.isfinite, tp2[name])), (name, tp2[name])
        assert ref[name][-1] < ref[name][0], f"{name} did not train under {precision}: {ref[name]}"
        diffs = update_diffs(tp_state, ref_state, start, name)
        worst = max(diffs, key=diffs.get)
        figures[name] = (rel_loss_diff(tp2[name], ref[name]), diffs[worst], worst)
        assert figures[name][0] < LOSS_TOL, f"{name}: TP=2 {tp2[name]} vs one process {ref[name]}"
        assert diffs[worst] < UPDATE_TOL, f"{name}: {worst}'s update differs by {diffs[worst]:.1%}"
    return ref_state, start, figures


def _print(title: str, figures: dict) -> None:
    print(f"\n{title}: max rel loss diff, max update diff (tensor)[, a wrong cut's]; bounds {LOSS_TOL:.1e}, "
          f"{UPDATE_TOL:.1%}\n" + "\n".join(f"  {n}: {f[0]:.1e} {f[1]:.2%} ({f[2].split('.', 2)[2]})"
                                           + "".join(f" {e:.1%}" for e in f[3:]) for n, f in figures.items()))


@pytest.mark.slow
@needs_transformers
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_fused_families_tp2_match_one_process_within_bf16_rounding(tmp_path, monkeypatch, precision):
    ref_state, start, figures = _tp2_against_one_process(tmp_path, precision, SPLIT)
    _wrong_cuts(monkeypatch)  # the same one-process run with each family's heads cut wrong: the check catches it
    fit(tmp_path / "wrong_cut", "auto", 1, names=SPLIT, **PRECISIONS[precision]())
    wrong = torch.load(tmp_path / "wrong_cut" / "final.ckpt", weights_only=False)["state_dict"]
    for name in SPLIT:
        effect = max(update_diffs(wrong, ref_state, start, name).values())
        assert effect > 2 * UPDATE_TOL, f"{name}: a wrong cut of its heads moves the updates by only {effect:.1%}"
        figures[name] += (effect,)
    _print(precision, figures)
    if precision == "O2":  # our plugin's state at TP=2: the midway checkpoint resumes onto the uninterrupted run
        resumed, _ = fit(tmp_path / "resumed", TensorParallelStrategy(start_method="spawn"), 2, names=SPLIT,
                         ckpt_path=str(tmp_path / "tp2" / "midway.ckpt"), **PRECISIONS[precision]())
        with open(tmp_path / "tp2" / "losses.json") as f:
            uninterrupted = json.load(f)
        assert all(resumed[name] == uninterrupted[name][MIDWAY:] for name in SPLIT), (resumed, uninterrupted)
        state, want = (torch.load(tmp_path / run / "final.ckpt", weights_only=False)["state_dict"]
                       for run in ("resumed", "tp2"))
        assert all(torch.equal(state[key], want[key]) for key in want)


@pytest.mark.slow
@needs_transformers
@pytest.mark.parametrize("names, precision", [
    pytest.param(("bloom", "mpt"), "O2", id="bloom-mpt-O2"),
    pytest.param(("falcon_new", "falcon_mq"), "bf16-mixed", id="falcon-bf16-mixed"),
])
def test_with_sequence_parallel_tp2_match_one_process_within_bf16_rounding(tmp_path, names, precision):
    """The same with sequence parallelism ([batch, seq, hidden]: ``sequence_dim=1``): the ALiBi and key/value cuts
    with the sequence scattered between the blocks. Falcon adds into its MLP's output in place (``mlp_output +=
    attention_output``): under sequence parallelism that is the row layer's reduce-scattered output, which autograd
    refused to modify while it was a view made inside the Function (``Output 0 of _ReduceScatterToSP is a view and is
    being modified inplace``, at every precision); the sequence-parallel regions now return tensors of their own."""
    _, _, figures = _tp2_against_one_process(tmp_path, precision, names, sequence_parallel=True, sequence_dim=1)
    _print(f"{precision}, sequence parallel", figures)
