"""AmpRuntime from a plain PyTorch loop (no Lightning), and the plugins built on it."""
import pytest
import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision

import lightning_amp
import lightning_amp.fabric as amp_fabric
from lightning_amp.amp import LEVEL_DEFAULTS, AmpRuntime
from lightning_amp.amp.o2.policy import installs
from lightning_amp.amp.runtime import named_params
from lightning_amp.plugin_base import plugin_name


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def test_a_plain_loop_steps_skips_and_releases():
    model = _model()
    amp = AmpRuntime("O2", dtype="float16", device_type="cpu", scaler_kwargs=dict(init_scale=2.0**8))
    amp.prepare(model)
    assert amp.holds_policy == (installs() > 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.connect([optimizer], named_params(model))
    before = [p.detach().clone() for p in model.parameters()]
    for fault in (False, True):
        with amp.forward_context():
            loss = model(amp.convert_input(torch.randn(4, 8))).float().pow(2).mean()
        with amp.backward_context():
            amp.scale_loss(loss).backward()
        if fault:
            next(model.parameters()).grad[0, 0] = float("inf")
            stepped = [p.detach().clone() for p in model.parameters()]
        amp.step(optimizer)
        optimizer.zero_grad()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, stepped))  # the clean step stepped
    assert all(torch.equal(a, b) for a, b in zip(stepped, model.parameters()))  # the faulty one was skipped
    assert amp.engine.skipped_steps == 1 and amp.engine.last_nonfinite_params == ["0.weight"]
    assert amp.loss_scale == 2.0**7
    amp.release()
    assert not amp.holds_policy and amp.module is None


def test_bad_options_name_the_argument():
    with pytest.raises(ValueError, match="`opt_level`"):
        AmpRuntime("O4")
    with pytest.raises(ValueError, match="`combine_grad`"):
        AmpRuntime("O1", combine_grad="yes")
    with pytest.raises(TypeError, match="loss-scaler keywords.*'init_scal'"):
        AmpRuntime("O1", scaler_kwargs=dict(init_scal=2.0))


def test_each_plugin_holds_a_runtime_on_lightnings_own_precision_classes():
    assert lightning_amp.AmpRuntime is AmpRuntime
    trainer, fabric = lightning_amp.AmpO2Precision(), amp_fabric.FabricAmpO2Precision()
    assert isinstance(trainer.amp, AmpRuntime) and isinstance(fabric.amp, AmpRuntime)
    assert isinstance(trainer, TrainerPrecision)
    assert isinstance(fabric, FabricPrecision) and not isinstance(fabric, TrainerPrecision)
    assert not isinstance(fabric, lightning_amp.AmpPrecision) and not isinstance(trainer, amp_fabric.FabricAmpPrecision)


@pytest.mark.parametrize("level", list(LEVEL_DEFAULTS))
def test_level_classes_come_from_the_level_table(level):
    for kind, base, module in (("trainer", lightning_amp.AmpPrecision, lightning_amp),
                               ("fabric", amp_fabric.FabricAmpPrecision, amp_fabric)):
        cls = getattr(module, plugin_name(kind, level))
        assert issubclass(cls, base) and cls.fixed_opt_level == level and cls.__name__ == plugin_name(kind, level)
        assert cls.__module__ == base.__module__ and level in cls.__doc__
        assert cls().properties.opt_level == level
        with pytest.raises(TypeError, match=f"{cls.__name__} fixes the opt level; use {base.__name__}\\(opt_level"):
            cls(opt_level="O1")


def test_the_level_resolved_for_the_device_makes_the_scalers_and_checks_the_optimizers():
    runtime = AmpRuntime("O1", dtype="float16", device_type="cuda")
    assert runtime.properties.scaling_enabled and runtime.new_scaler().static_scale is None
    weight = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match=r"optimizers\[0\] \(LBFGS\).*opt_level=O1"):
        runtime.add_optimizer(torch.optim.LBFGS([weight]))
    bf16 = AmpRuntime("O1", device_type="cuda")
    bf16.resolve_for("cpu")  # dtype "auto" on the CPU: bfloat16, no loss scaling
    assert bf16.properties.dtype == torch.bfloat16 and not bf16.properties.scaling_enabled
    state = bf16.add_optimizer(torch.optim.LBFGS([weight]))
    assert state.scaler.static_scale == 1.0 and bf16.engine.scalers == [state.scaler]
