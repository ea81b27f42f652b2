"""TensorParallelConfig: validated once at construction, frozen, and the one object the strategies pass down."""
import dataclasses
import pickle

import pytest

from lightning_amp import TensorParallelStrategy
from lightning_amp.fabric import TensorParallelStrategy as FabricTensorParallelStrategy
from lightning_amp.parallel import TensorParallelConfig


@pytest.mark.parametrize("kwargs, error, match", [
    ({"tensor_parallel_size": 0}, ValueError, "tensor_parallel_size must be 'auto' or a positive int"),
    ({"tensor_parallel_size": True}, ValueError, "tensor_parallel_size must be 'auto' or a positive int"),
    ({"sequence_parallel": "yes"}, TypeError, "sequence_parallel must be a bool"),
    ({"gradient_accumulation_fusion": 1}, TypeError, "gradient_accumulation_fusion must be a bool"),
    ({"async_grad_allreduce": None}, TypeError, "async_grad_allreduce must be a bool"),
    ({"overlap_grad_reduce": "no"}, TypeError, "overlap_grad_reduce must be a bool"),
    ({"allow_replicated": "yes"}, TypeError, "allow_replicated must be a bool"),
    ({"sequence_dim": 2}, ValueError, r"sequence_dim must be None .* 0 .* or 1"),
    ({"bucket_numel": 0}, ValueError, "bucket_numel must be a positive int"),
    ({"plan": {"a.*": "diagonal"}}, ValueError, r"plan entry 'a\.\*': 'diagonal' must be one of \('column', 'row', 'replicated', 'attention', 'replicate'\)"),
    ({"plan": ["a"]}, TypeError, "plan must be 'auto' or a dict"),
])
def test_bad_options_raise_naming_the_argument_and_the_allowed_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        TensorParallelConfig(**kwargs)
    with pytest.raises(error, match=match):  # the strategies' keywords go through the same check
        TensorParallelStrategy(**kwargs)
    with pytest.raises(error, match=match):
        FabricTensorParallelStrategy(**kwargs)


def test_config_is_frozen_copies_the_plan_and_pickles():
    plan = {"layers.*.linear1": "column", "layers.*.linear2": "row"}
    config = TensorParallelConfig(tensor_parallel_size=2, plan=plan)
    plan["x"] = "row"
    assert "x" not in config.plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.bucket_numel = 1
    assert pickle.loads(pickle.dumps(config)) == config  # spawned ranks receive the strategy pickled
    assert config.tp_size(devices_per_node=4) == 2 and TensorParallelConfig().tp_size(devices_per_node=4) == 4
    assert config.replace(sequence_parallel=True).sequence_parallel
    with pytest.raises(TypeError, match="sequence_parallel must be a bool"):
        config.replace(sequence_parallel="yes")


def test_strategies_take_a_config_or_the_keywords_not_both():
    config = TensorParallelConfig(tensor_parallel_size=2, bucket_numel=1024)
    for cls in (TensorParallelStrategy, FabricTensorParallelStrategy):
        assert cls(config=config).config is config
        assert cls(tensor_parallel_size=2, bucket_numel=1024).config == config
        with pytest.raises(ValueError, match="either in config=TensorParallelConfig.* not both: got config and bucket_numel"):
            cls(config=config, bucket_numel=7)
        with pytest.raises(TypeError, match="config must be a TensorParallelConfig"):
            cls(config={"tensor_parallel_size": 2})


def test_full_state_dict_on_call_is_scoped_and_reentrant():
    """The spawn launcher's gather: inside the context module.state_dict() is the runtime's full state (here, one
    process and an unconverted module: the plain state), nested calls do not recurse, and the hook is gone after."""
    import torch
    from torch import nn

    from lightning_amp.parallel.runtime import TensorParallelRuntime

    runtime, module = TensorParallelRuntime(), nn.Linear(3, 2)
    calls = []
    original = runtime.full_state_dict
    runtime.full_state_dict = lambda m: calls.append(m) or {k: v * 0 for k, v in original(m).items()}
    with runtime.full_state_dict_on_call(module):
        state = module.state_dict()
    assert calls == [module] and all(torch.equal(v, torch.zeros_like(v)) for v in state.values())
    assert set(state) == {"weight", "bias"}
    assert torch.equal(module.state_dict()["weight"], module.weight) and calls == [module]  # hook removed
    assert "state_dict" not in vars(module)  # the bound method is never swapped
