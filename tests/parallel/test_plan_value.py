"""The plan is a value: reading a model gives ``{module path: Style}`` (``TensorParallelPlan``) that prints as the report,
round-trips through JSON (and YAML where pyyaml is installed), and goes back in as ``plan=`` unchanged or edited;
torch's own plan dicts (``ColwiseParallel()``, ``RowwiseParallel()``, ``SequenceParallel()``,
``PrepareModuleInput(...)``: Lightning's tensor-parallel example's, tests/support/scripts/torchtitan_tp.py) and
glob paths give the plan the reading gives; bad entries are refused naming the entry and the reason, before any
change to the model. On 2 gloo ranks at fp32 (slow): Lightning's example model (torchtitan's Llama, which
tests/support/torchtitan_llama.py is) trained under tp_fused with its own plan dict, with none, and with the automatic
plan passed back as JSON, each within 1e-5 of one process per step; the auto plan of Llama, GPT-2, Phi-3, Falcon
(both variants), BLOOM and MPT (their per-head ALiBi inputs held by the plan) passed back as JSON trains as one process
does, and its checkpoint loads strictly into the plain model."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from torch import nn

from lightning_amp.parallel import TensorParallelConfig
from lightning_amp.parallel.plan import Style, TensorParallelPlan, build_plan
from support.families_zoo import STEPS, Zoo, fit, needs_transformers, rel_loss_diff, state_diff
from support.processes import run_ranks
from support.scripts import torchtitan_tp as loop

FAMILIES = ("llama", "gpt2", "phi3", "falcon_mq", "falcon_new", "bloom", "mpt")


def _family(name: str) -> nn.Module:
    from support.families_zoo import hf_models

    torch.manual_seed(0)
    return hf_models((name,))[name]


def _state(model: nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


@needs_transformers
@pytest.mark.parametrize("name", FAMILIES)
def test_the_auto_plan_round_trips_through_json_and_back_as_plan(name):
    model = _family(name)
    plan = build_plan(model, "auto", 2)
    assert isinstance(plan, TensorParallelPlan) and plan.tensor_parallel_size == 2
    text = plan.to_json()
    assert TensorParallelPlan.from_json(text) == plan  # the value itself
    again = build_plan(model, text, 2)  # passed back as plan=: read and confirmed, the same plan
    assert again == plan and again.format() == plan.format()
    assert build_plan(model, json.loads(text), 2) == plan  # its dict form too
    assert [u.members for u in again.units] == [u.members for u in plan.units] and again.whole == plan.whole
    assert [u.head_inputs for u in again.units] == [u.head_inputs for u in plan.units]
    alibi = {"bloom": "alibi", "mpt": "position_bias"}.get(name)  # cut to each rank's heads by the plan's entries
    assert alibi is None or alibi in {i.name for u in again.units for inputs in u.head_inputs.values() for i in inputs}


@needs_transformers
def test_per_head_inputs_the_plan_states_are_checked_against_the_reading():
    model = _family("bloom")
    auto = build_plan(model, "auto", 2).to_dict()
    key = next(path for path, style in auto.items() if "head_inputs" in style)
    (path, inputs), = auto[key]["head_inputs"].items()
    message = _refused(model, dict(auto, **{key: dict(auto[key], head_inputs={path: inputs[:1]})}))
    assert f"plan entry {key!r}" in message and "a layout the reading cannot confirm" in message
    with pytest.raises(TypeError, match=f"plan entry '{key}': head_inputs"):
        build_plan(model, dict(auto, **{key: dict(auto[key], head_inputs={path: ["alibi"]})}), 2)


@pytest.mark.skipif(importlib.util.find_spec("yaml") is None, reason="pyyaml is not installed")
@needs_transformers
def test_the_plan_round_trips_through_yaml():
    import yaml

    model = _family("phi3")
    plan = build_plan(model, "auto", 2)
    assert build_plan(model, yaml.safe_load(yaml.safe_dump(plan.to_dict())), 2) == plan


@needs_transformers
def test_the_plan_prints_as_the_report_and_holds_what_a_split_needs():
    plan = build_plan(_family("phi3"), "auto", 2)
    text = str(plan)
    assert text.startswith("tp_fused plan at tensor_parallel_size=2: 4 unit(s) split, 1 layer(s) left whole")
    assert "attention (found by structure): 4 query heads of 8, 2 per rank; 2 key/value heads, 1 per rank" in text
    assert "  left whole:\n    lm_head: its output leaves the model" in text
    qkv, gate_up = plan["model.layers.0.self_attn.qkv_proj"], plan["model.layers.0.mlp.gate_up_proj"]
    assert (qkv.style, qkv.heads, qkv.kv_heads, qkv.head_size) == ("column", 4, 2, 8)  # fused [q | k | v] by heads
    assert qkv.attention == dict(n_head=4, n_kv=2, head_size=8, v_size=8, layout="blocks", groups=0)
    assert (gate_up.style, gate_up.chunks) == ("column", 2)  # matching gate and up rows on each rank
    assert plan["model.layers.0.self_attn.o_proj"].unit == "model.layers.0.self_attn.qkv_proj"


def _titan(n_kv: int = 2):
    from support import torchtitan_llama as tt

    torch.manual_seed(0)
    return tt.Transformer(tt.ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=n_kv, vocab_size=64, max_seq_len=8))


def test_lightnings_example_plan_dict_gives_the_auto_plans_blocks_and_a_gathered_vocabulary_head():
    model = _titan()
    auto = build_plan(model, "auto", 2)
    given = build_plan(model, loop.lightning_example_plan(), 2)
    blocks = [p for p in auto if p.startswith("layers.") and auto[p].style != "replicate"]
    assert len(blocks) == 14 and {p: given[p] for p in blocks} == {p: auto[p] for p in blocks}
    assert given["output"].style == "column" and given.units[-1].rows == []  # ColwiseParallel(output=Replicate())
    heads = given["layers.0.attention.wq"].attention  # read from the forward: the example divides n_heads by hand
    assert (heads["n_head"], heads["n_kv"], heads["layout"]) == (4, 2, "separate")


def test_at_tp4_replicated_key_value_heads_round_trip_and_the_example_plan_gives_them_too():
    from support import torchtitan_llama as tt

    torch.manual_seed(0)
    model = tt.Transformer(tt.ModelArgs(dim=32, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=64, max_seq_len=8))
    auto = build_plan(model, "auto", 4)
    assert auto["layers.0.attention.wk"].style == "replicated" and auto["layers.0.attention.wk"].kv_heads == 2
    assert auto["layers.0.attention.wq"].per_rank == {"layers.0.attention:n_rep": 2}  # 2 query heads per kv head
    assert build_plan(model, auto.to_json(), 4) == auto
    given = build_plan(model, loop.lightning_example_plan(), 4)
    assert {p: given[p] for p in auto.decisions} == {p: auto[p] for p in auto.decisions}


def test_glob_paths_give_the_plan_the_reading_gives():
    model = _titan()
    auto = build_plan(model, "auto", 2)
    globbed = build_plan(model, {"layers.*.attention.w[qkv]": "column", "layers.*.attention.wo": "row",
                                 "layers.*.feed_forward.w[13]": "column", "layers.*.feed_forward.w2": "row"}, 2)
    split = lambda plan: {p: s for p, s in plan.items() if s.style != "replicate"}  # noqa: E731
    assert split(globbed) == split(auto) and list(globbed.whole) == list(auto.whole) == ["output"]


def test_an_edited_plan_goes_back_in_a_unit_left_whole():
    model = _titan()
    edited = build_plan(model, "auto", 2).to_dict()
    for path in [p for p in edited if p.startswith("layers.1.feed_forward.")]:
        edited[path] = {"style": "replicate", "reason": "kept whole on purpose"}
    plan = build_plan(model, edited, 2)
    assert plan.whole["layers.1.feed_forward.w2"] == "kept whole on purpose"
    assert [u.family for u in plan.units] == ["attention", "named MLP", "attention"]


def _refused(model: nn.Module, plan, tp: int = 2) -> str:
    before = _state(model)
    kinds = [type(m) for m in model.modules()]
    with pytest.raises(ValueError) as error:
        build_plan(model, plan, tp)
    after = _state(model)
    assert [type(m) for m in model.modules()] == kinds and all(torch.equal(before[k], after[k]) for k in before)
    return str(error.value)


def test_bad_entries_are_refused_naming_the_entry_and_the_reason_before_any_change():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = _titan()
    message = _refused(model, {"layers.*.attention.wz": ColwiseParallel()})
    assert "plan entry 'layers.*.attention.wz' matches no module of Transformer" in message
    message = _refused(model, {"tok_embeddings": RowwiseParallel()})
    assert "plan entry 'tok_embeddings'" in message and "is a Embedding" in message and "vocabulary-parallel" in message
    auto = build_plan(model, "auto", 2).to_dict()
    wrong = dict(auto, **{"layers.0.attention.wq": dict(auto["layers.0.attention.wq"], attention=dict(
        auto["layers.0.attention.wq"]["attention"], n_kv=4))})
    message = _refused(model, wrong)
    assert "plan entry 'layers.0.attention.wq'" in message and "a layout the reading cannot confirm" in message
    assert "'n_kv': 4" in message and "'n_kv': 2" in message
    message = _refused(model, dict(auto, **{"layers.0.feed_forward.w1": {"style": "column", "chunks": 2}}))
    assert "plan entry 'layers.0.feed_forward.w1'" in message and "{'chunks': 2}" in message
    message = _refused(_titan(n_kv=2), auto, tp=4)  # read at tp=2: 2 key/value heads are replicated at 4, n_rep differs
    assert "a layout the reading cannot confirm" in message
    message = _refused(model, {"layers.*.attention.w[qkv]": "column", "layers.*.attention.wo": "row"}, tp=3)
    assert "4 query heads not divisible by tensor_parallel_size=3" in message


def test_a_style_tp_fused_does_not_support_is_refused_when_the_options_are_built():
    from torch.distributed.tensor.parallel import ColwiseParallel

    class Float8Colwise(ColwiseParallel):
        pass

    with pytest.raises(ValueError, match=r"plan entry 'layers\.\*\.w1': Float8Colwise is not a style tp_fused supports"):
        TensorParallelConfig(plan={"layers.*.w1": Float8Colwise()})
    with pytest.raises(ValueError, match=r"plan entry 'a\.b': 'split' must be one of"):
        TensorParallelConfig(plan='{"a.b": {"style": "split"}}')
    with pytest.raises(ValueError, match=r"plan entry 'a\.b': unknown field\(s\) \['head'\]"):
        TensorParallelConfig(plan={"a.b": {"style": "column", "head": 2}})
    with pytest.raises(TypeError, match=r"plan entry 'a\.b': chunks must be int"):
        TensorParallelConfig(plan={"a.b": {"style": "column", "chunks": "2"}})
    config = TensorParallelConfig(plan={"w": ColwiseParallel()})  # parsed once: no torch style object kept
    assert config.plan == TensorParallelPlan({"w": Style("column")})


@pytest.fixture(scope="module")
def titan_runs(tmp_path_factory) -> dict:
    """Lightning's example model on 2 gloo ranks under Fabric's tp_fused: its own plan dict, none, the auto plan as
    JSON; and the multi-query variant with the example's plan (one key/value head: replicated, not divided)."""
    out = tmp_path_factory.mktemp("plans")
    runs = {"gqa": None, "gqa+lightning": "lightning", "gqa+auto_json": "auto_json", "mqa+lightning": "lightning"}
    spec = [[run, dict(name=run.split("+")[0], devices=2, plan=plan)] for run, plan in runs.items()]
    run_ranks("torchtitan_tp", (out, json.dumps(spec)), 2)
    return {run: [torch.load(out / f"{run}.rank{r}.pt", weights_only=False) for r in range(2)] for run in runs}


@pytest.mark.slow
@pytest.mark.parametrize("run", ["gqa", "gqa+lightning", "gqa+auto_json", "mqa+lightning"])
def test_lightnings_example_trains_under_its_own_plan_dict_as_one_process(titan_runs, run):
    one, ranks = loop.train(run.split("+")[0]), titan_runs[run]
    losses = [abs(a - b) / b for a, b in zip(ranks[0]["losses"], one["losses"])]
    weights = [max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)
               for a, b in zip(ranks[0]["weights"], one["weights"])]
    print(f"\n{run}: max rel loss diff {max(losses):.1e}, max rel weight diff {max(weights):.1e}")
    assert len(losses) == loop.STEPS and max(losses) < 1e-5 and max(weights) < 1e-5, (losses, weights)
    loop.model(run.split("+")[0]).load_state_dict(ranks[0]["weights"][-1])  # strict: the plain model's layout
    plan = TensorParallelPlan.parse(ranks[0]["plan"])  # strategy.plan after setup, as its dict
    assert plan["layers.1.feed_forward.w2"].style == "row" and plan["layers.1.attention.wk"].style in ("column", "replicated")
    assert ("output" in plan.decisions) == run.endswith("lightning")  # the example's plan splits the vocabulary head


@pytest.mark.slow
@needs_transformers
def test_the_auto_plan_as_json_trains_each_family_as_one_process(tmp_path):
    from lightning_amp.trainer.strategy import TensorParallelStrategy

    plan = build_plan(Zoo(names=FAMILIES), "auto", 2).to_json()
    ref, _ = fit(tmp_path / "single", "auto", 1, names=FAMILIES)
    tp2, _ = fit(tmp_path / "tp2", TensorParallelStrategy(plan=plan, start_method="spawn"), 2, names=FAMILIES)
    ref_state = torch.load(tmp_path / "single" / "final.ckpt", weights_only=False)["state_dict"]
    tp_state = torch.load(tmp_path / "tp2" / "final.ckpt", weights_only=False)["state_dict"]
    Zoo(names=FAMILIES).load_state_dict(tp_state)  # strict: the plain model's keys and shapes
    for name in FAMILIES:
        loss, weights = rel_loss_diff(tp2[name], ref[name]), state_diff(tp_state, ref_state, f"families.{name}.")
        print(f"\n{name}: max rel loss diff {loss:.1e}, checkpoint diff {weights:.1e} (rel. to max |w|)")
        assert len(tp2[name]) == STEPS and loss < 1e-5, (name, tp2[name], ref[name])
        assert weights < 1e-5, name


def test_the_reading_knows_nothing_of_the_conversion_and_the_conversion_takes_only_a_plan():
    """parallel/reading/ imports only itself (and torch): no plan value, layer, collective or conversion; the
    conversion's one entry takes the plan and reads nothing else of the model's layout."""
    import ast
    import inspect
    import pathlib

    import lightning_amp.parallel.convert as convert
    import lightning_amp.parallel.reading as reading

    outside = []
    for path in sorted(pathlib.Path(reading.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_amp"):
                if not node.module.startswith("lightning_amp.parallel.reading"):
                    outside.append(f"{path.name}: {node.module}")
    assert outside == []
    assert list(inspect.signature(convert.convert).parameters) == ["module", "checked", "group", "config", "layer_kwargs"]
    source = inspect.getsource(convert)
    assert "auto_units" not in source and "reading.structure" not in source and "reading.unsplit" not in source


class _Unread(nn.Module):
    """A model the plan must not go back to: any walk of its modules fails."""

    def named_modules(self, *args, **kwargs):
        raise AssertionError("the plan went back to the model")

    get_submodule = modules = named_modules


@needs_transformers
@pytest.mark.parametrize("name", ["llama", "bloom"])
def test_the_plan_is_decided_on_the_model_read_once(name):
    """``build_plan`` is ``check_plan(read_model(model))``: the auto plan, and an explicit plan of whole units, are
    decided on the reading alone (its layer table, units, reasons and whole attentions), with the model out of reach;
    only an explicit plan's own column -> row pairs and sequence parallelism's blocks go back to it."""
    from lightning_amp.parallel.plan import check_plan
    from lightning_amp.parallel.reading.model_reading import read_model

    model = _family(name)
    reading = read_model(model, 2)
    auto = build_plan(model, "auto", 2)
    reading.model = _Unread()
    assert check_plan(reading, "auto") == auto
    assert check_plan(reading, auto.to_json()) == auto  # the units it names are the reading's: nothing else to read
    assert reading.model_name == "_Unread"


@needs_transformers
def test_a_vocabulary_head_under_an_unreadable_forward_is_left_whole_for_its_own_reason():
    """BLOOM's forward cannot be read by torch.fx as a whole (its blocks are, one by one): its ``lm_head``, the only
    layer of the model outside the blocks, is left whole because nothing pairs with it, and the reason says so."""
    why = build_plan(_family("bloom"), "auto", 2).whole["lm_head"]
    assert why.startswith("the only layer of the model outside its sub-modules, so nothing to pair it with (a "
                          "vocabulary head or a classifier stays whole)"), why
