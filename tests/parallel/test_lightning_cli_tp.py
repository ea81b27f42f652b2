"""tp_fused from LightningCLI (issue 47: the plan "round-trips through JSON/YAML, so LightningCLI configs can hold it").

jsonargparse reads a strategy's options from its ``__init__`` signature and follows ``**kwargs`` into the base class:
through Lightning's ``DDPStrategy`` it reached torch's ``DistributedDataParallel`` and handed tp_fused every one of its
defaults (``output_device``, ``dim``, ``broadcast_buffers``, ...), which tp_fused refuses, so any config naming the
class failed ("got an unexpected keyword argument 'output_device'"). Here: a YAML config with the class, a plan
mapping (styles, globs, a per-block dict, torch's styles by ``class_path``) and the other options parses into a
Trainer whose strategy holds them; the automatic plan of a model, printed by ``to_dict()``/``to_json()`` and pasted
into a config, comes back equal and is confirmed by the reading; a bad option is a usage error naming it, a bad
value one that only ``TensorParallelConfig`` sees an error naming the argument. Slow: a CLI-configured ``fit`` on 2
gloo ranks at fp32 ends with the weights of the same config run as one process.
"""
from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.utils.data import DataLoader

from lightning_amp import TensorParallelStrategy
from lightning_amp.parallel import TensorParallelConfig
from lightning_amp.parallel.plan import TensorParallelPlan, build_plan
from support.processes import free_port
from support.trainer import quiet_lightning

PLAN = {
    "layers.*.attention.w[qkv]": "column",
    "layers.*.attention.wo": "row",
    "layers.*.feed_forward": {"w1": "column", "w3": "column", "w2": "row"},  # a per-block plan under a glob
    "output": {"style": "replicate", "reason": "kept whole on purpose"},  # a Style's dict form
}
OPTIONS = dict(tensor_parallel_size=2, sequence_parallel=True, sequence_dim=1, gradient_accumulation_fusion=False,
               async_grad_allreduce=False, bucket_numel=1024, overlap_grad_reduce=False, allow_replicated=True,
               unsplit_ok=["transformer.h.*.self_attention"])


def _cli(*args: str, run: bool = False, model=BoringModel) -> LightningCLI:
    with quiet_lightning():
        return LightningCLI(model, run=run, save_config_kwargs={"overwrite": True},
                            args=[*args] if run else ["--trainer.accelerator", "cpu", *args])


def _config(tmp_path, strategy: dict) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"accelerator": "cpu", "devices": 2, "strategy": strategy}}))
    return str(path)


def _tp(strategy: dict, tmp_path) -> TensorParallelStrategy:
    strategy_obj = _cli("--config", _config(tmp_path, strategy)).trainer.strategy
    assert type(strategy_obj) is TensorParallelStrategy
    return strategy_obj


def test_a_yaml_config_holds_the_strategy_its_plan_and_options(tmp_path):
    strategy = _tp({"class_path": "lightning_amp.TensorParallelStrategy",
                    "init_args": dict(OPTIONS, plan=PLAN, process_group_backend="gloo", start_method="spawn")},
                   tmp_path)
    config = strategy.config
    assert config == TensorParallelConfig(plan=PLAN, **OPTIONS)  # every option as given; unsplit_ok kept as a tuple
    assert config.plan == TensorParallelPlan.parse(PLAN) and config.plan["output"].reason == "kept whole on purpose"
    assert (strategy._process_group_backend, strategy._start_method) == ("gloo", "spawn")


@pytest.mark.parametrize("framework", ["trainer", "fabric"])
def test_the_strategies_name_every_keyword_of_lightnings_ddp_strategy_but_the_wrappers(framework):
    """The signature jsonargparse reads passes DDPStrategy's keywords on by name: one Lightning adds, renames or gives
    another default fails here (the comm-hook keywords configure torch's DDP wrapper, which tp_fused has not)."""
    from lightning.fabric import strategies as fabric_strategies
    from lightning.pytorch import strategies as trainer_strategies

    from lightning_amp import fabric

    ours, theirs = {"trainer": (TensorParallelStrategy, trainer_strategies.DDPStrategy),
                    "fabric": (fabric.TensorParallelStrategy, fabric_strategies.DDPStrategy)}[framework]
    wrapper = {"ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period"}
    our_params = inspect.signature(ours.__init__).parameters
    their_params = {n: p for n, p in inspect.signature(theirs.__init__).parameters.items()
                    if n not in ("self", "kwargs") and n not in wrapper}
    assert not any(p.kind is p.VAR_KEYWORD for p in our_params.values()) and not wrapper & set(our_params)
    assert {n: our_params[n].default for n in their_params if n in our_params} == \
        {n: p.default for n, p in their_params.items()}


def test_the_docs_config_parses_into_the_strategy_it_describes(tmp_path):
    page = (Path(__file__).parents[2] / "docs" / "tensor-parallel.md").read_text()
    block = page.split("### In a LightningCLI config", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "docs.yaml").write_text(block)
    strategy = _cli("--config", str(tmp_path / "docs.yaml")).trainer.strategy
    given = yaml.safe_load(block)["trainer"]["strategy"]["init_args"]
    plan = dict(given["plan"], norm=SequenceParallel())
    assert type(strategy) is TensorParallelStrategy
    assert strategy.config == TensorParallelConfig(**dict(given, plan=plan)) and strategy.config.plan == TensorParallelPlan.parse(plan)


def test_torchs_styles_are_given_by_class_path(tmp_path):
    plan = {"layers.*.attention.wq": {"class_path": "torch.distributed.tensor.parallel.ColwiseParallel"},
            "layers.*.attention.wo": {"class_path": "RowwiseParallel"}}
    strategy = _tp({"class_path": "TensorParallelStrategy", "init_args": {"plan": plan}}, tmp_path)
    assert strategy.config.plan == TensorParallelPlan.parse({"layers.*.attention.wq": ColwiseParallel(),
                                                             "layers.*.attention.wo": RowwiseParallel()})


def test_the_registered_names_and_the_command_line():
    assert type(_cli("--trainer.strategy", "tp_fused").trainer.strategy) is TensorParallelStrategy
    spawned = _cli("--trainer.strategy", "tp_fused_spawn").trainer.strategy
    assert type(spawned) is TensorParallelStrategy and spawned._start_method == "spawn"
    strategy = _cli("--trainer.devices", "2", "--trainer.strategy", "TensorParallelStrategy",
                    "--trainer.strategy.tensor_parallel_size", "2",
                    "--trainer.strategy.plan", json.dumps(PLAN), "--trainer.strategy.unsplit_ok", '["a.*"]').trainer.strategy
    assert strategy.config == TensorParallelConfig(tensor_parallel_size=2, plan=PLAN, unsplit_ok=("a.*",))


def test_a_config_can_hold_a_tensor_parallel_config_instead(tmp_path):
    given = dict(OPTIONS, plan=PLAN)
    strategy = _tp({"class_path": "TensorParallelStrategy", "init_args": {"config": given}}, tmp_path)
    assert strategy.config == TensorParallelConfig(**given)
    with pytest.raises(ValueError, match="either in config=TensorParallelConfig.* not both: got config and sequence_parallel"):
        _tp({"class_path": "TensorParallelStrategy", "init_args": {"config": given, "sequence_parallel": True}},
            tmp_path)


def _llama() -> torch.nn.Module:
    from support import torchtitan_llama as tt

    torch.manual_seed(0)
    return tt.Transformer(tt.ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=8))


@pytest.mark.parametrize("form", ["to_dict as YAML", "to_json as a YAML string", "to_json in a JSON config"])
def test_a_printed_plan_pasted_into_a_config_round_trips(tmp_path, form):
    model = _llama()
    auto = build_plan(model, "auto", 2)
    if form == "to_json in a JSON config":  # JSON is YAML: a config written as JSON, the plan's JSON inside it
        path = tmp_path / "config.json"
        strategy = {"class_path": "TensorParallelStrategy", "init_args": {"plan": json.loads(auto.to_json())}}
        path.write_text(json.dumps({"trainer": {"accelerator": "cpu", "devices": 2, "strategy": strategy}}))
        config = _cli("--config", str(path)).trainer.strategy.config
    else:
        plan = auto.to_dict() if form == "to_dict as YAML" else auto.to_json()
        config = _tp({"class_path": "TensorParallelStrategy", "init_args": {"plan": plan}}, tmp_path).config
    assert config.plan == auto and config.plan.to_dict() == auto.to_dict()
    assert build_plan(model, config.plan, 2) == auto  # read back and confirmed by the reading: the same plan


@pytest.mark.parametrize("init_args, named", [
    ({"sequence_paralel": True}, "Option 'sequence_paralel' is not accepted"),
    ({"find_unused_parameters": True}, "Option 'find_unused_parameters' is not accepted"),  # no DDP wrapper
    ({"ddp_comm_hook": None}, "Option 'ddp_comm_hook' is not accepted"),
    ({"tensor_parallel_size": "two"}, 'Parser key "tensor_parallel_size"'),
    ({"sequence_dim": 2}, 'Parser key "sequence_dim"'),
    ({"plan": {"layers.0.attention.wq": "colum"}}, 'Parser key "plan"'),
])
def test_a_bad_option_is_a_usage_error_naming_it(tmp_path, capsys, init_args, named):
    with pytest.raises(SystemExit) as exit_info:
        _tp({"class_path": "TensorParallelStrategy", "init_args": init_args}, tmp_path)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("usage:") and named in err, err


@pytest.mark.parametrize("init_args, message", [
    ({"bucket_numel": 0}, "TensorParallelStrategy: bucket_numel must be a positive int, got 0"),
    ({"plan": {"a.b": {"style": "column", "head": 2}}}, r"plan entry 'a.b': unknown field(s) ['head']"),
    ({"plan": "autp"}, "plan must be 'auto' or a dict"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be 'auto' or a positive int, got 0"),
])
def test_a_bad_value_the_parser_cannot_see_names_the_argument(tmp_path, init_args, message):
    with pytest.raises((ValueError, TypeError)) as info:
        _tp({"class_path": "TensorParallelStrategy", "init_args": init_args}, tmp_path)
    assert message in str(info.value)


class _TwoLayers(BoringModel):
    """Lightning's BoringModel with a column and a row layer (32 -> 16 -> 2), the unit tp_fused splits, and its
    random batches drawn from their own generator (the same in every process, whatever the global RNG did)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.randn(24, 32, generator=torch.Generator().manual_seed(3)), batch_size=4)


def _fit_config(tmp_path, name: str, strategy) -> str:
    trainer = {"accelerator": "cpu", "devices": 1 if strategy == "auto" else 2, "strategy": strategy, "max_steps": 5,
               "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
               "enable_model_summary": False, "default_root_dir": str(tmp_path / name),
               "use_distributed_sampler": False}  # dp = 1: both ranks read every batch, unshuffled, as one process
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"seed_everything": 7, "trainer": trainer}))
    return str(path)


def _fit(config: str) -> torch.nn.Module:
    os.environ["MASTER_PORT"] = str(free_port())
    return _cli("fit", "--config", config, run=True, model=_TwoLayers).model


@pytest.mark.slow
def test_a_cli_configured_fit_on_2_gloo_ranks_ends_as_one_process(tmp_path):
    strategy = {"class_path": "TensorParallelStrategy",
                "init_args": {"plan": {"layer.0": "column", "layer.2": "row"}, "start_method": "spawn"}}
    tp_config, one_config = _fit_config(tmp_path, "tp2", strategy), _fit_config(tmp_path, "one", "auto")
    start = _cli("--config", one_config, model=_TwoLayers).model.state_dict()  # seeded by the config: the start
    tp, one = _fit(tp_config), _fit(one_config)
    print("\nmax |tp2 - one process| / max |w| per tensor:",
          {k: f"{((w - one.state_dict()[k]).abs().max() / one.state_dict()[k].abs().max()).item():.1e}"
           for k, w in tp.state_dict().items()})
    for (key, got), want, first in zip(tp.state_dict().items(), one.state_dict().values(), start.values()):
        assert got.shape == want.shape, key  # gathered back: the plain model's layout
        assert (got - want).abs().max() <= 1e-6 * want.abs().max() < (want - first).abs().max(), key  # and it trained
